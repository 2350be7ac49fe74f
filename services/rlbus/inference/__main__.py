"""``python -m rlbus.inference``: parse settings first, import torch only after."""

from rlbus.runner import run_service

if __name__ == "__main__":
    run_service("inference")

"""``python -m rlbus.reward``: parse settings first, import heavy modules only after."""

from rlbus.runner import run_service

if __name__ == "__main__":
    run_service("reward")

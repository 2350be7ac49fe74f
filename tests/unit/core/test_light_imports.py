"""shared/ stays light: importing it must not pull in torch, transformers or vllm."""

import subprocess
import sys


def test_shared_does_not_import_heavy_frameworks():
    code = (
        "import sys, rlbus.settings, rlbus.messages, rlbus.codec, rlbus.topics, "
        "rlbus.transport, rlbus.service, rlbus.client\n"
        "heavy = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""

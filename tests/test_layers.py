"""The language, the model, the search and their CLI never import torch or the engines."""
import subprocess
import sys


def test_core_layers_do_not_import_engines():
    code = ("import sys, koala_ds, koala_ds.dsl, koala_ds.library, koala_ds.sim, koala_ds.search, koala_ds.viz, "
            "koala_ds.cli\n"
            "from koala_ds.cli import build_parser\n"
            "build_parser()\n"
            "from koala_ds.library import get\n"
            "get('zb-v').compile(4, 8, 2)\n"
            "bad = [m for m in ('torch', 'deepspeed', 'megatron') if m in sys.modules]\n"
            "print(','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"imported: {out.stdout.strip()}"

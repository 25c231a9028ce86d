"""The language, the model, the search and their CLI never import torch or the engines."""
import subprocess
import sys


def test_core_layers_do_not_import_engines():
    code = ("import sys, koala_ds, koala_ds.dsl, koala_ds.library, koala_ds.sim, koala_ds.search, koala_ds.viz, "
            "koala_ds.cli\n"
            "from koala_ds.cli import build_parser\n"
            "build_parser()\n"
            "from koala_ds.library import get\n"
            "get('zb-v').compile(4, 8, 2)\n")
    assert_imports_no_engine(code)


def assert_imports_no_engine(code: str) -> None:
    """Run `code` in a fresh interpreter: it must import none of torch, deepspeed, megatron."""
    code += "\nbad = [m for m in ('torch', 'deepspeed', 'megatron') if m in sys.modules]\nprint(','.join(bad))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"imported: {out.stdout.strip()}"


def test_the_package_docstring_is_true_about_which_adapters_are_lazy():
    # koala_ds/__init__.py: the resolver, the Megatron adapter's front (flags, install checks)
    # and the profiler import no engine; koala_ds.deepspeed does import DeepSpeed
    code = ("import argparse, sys, koala_ds, koala_ds.resolve, koala_ds.megatron, koala_ds.profiler\n"
            "from koala_ds.resolve import MEGATRON, resolve\n"
            "resolve('zb-v', 2, 8, 2, MEGATRON)\n"
            "args = koala_ds.megatron.add_arguments(argparse.ArgumentParser()).parse_args(\n"
            "    ['--pipeline-schedule', 'koala', '--koala-schedule', '1f1b'])\n"
            "args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size = 2, None\n"
            "koala_ds.megatron.schedule_from_args(args)\n")
    assert_imports_no_engine(code)
    import koala_ds

    assert "`koala_ds.deepspeed` is not lazy" in koala_ds.__doc__


def test_the_installed_package_holds_no_test_harness_and_writes_nothing_beside_itself():
    # the DeepSpeed job harness used to build extensions into <install>/../.cache: it is in tests/ now
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "koala_ds"
    offenders = [str(path.relative_to(package)) for path in sorted(package.rglob("*.py"))
                 if any(word in path.read_text(encoding="utf-8") for word in ("TORCH_EXTENSIONS_DIR", '".cache"'))]
    assert offenders == []
    assert all((Path(__file__).parent / name).is_file() for name in ("deepspeed_jobs.py", "engine_runs.py"))


def test_each_layer_imports_only_the_layers_below_it():
    """core < language (dsl, library) < model (sim, viz) < search < resolve < runtime < adapters <
    profiler (it measures what the adapters run) < commands, cli:
    no module imports a layer above its own, not even for type checking (the core's lowered form
    took a cost profile from the model; the resolver sat beside the IR while reading the library
    and profiles)."""
    import ast
    from pathlib import Path

    level = {"core": 0, "dsl": 1, "library": 1, "sim": 2, "viz": 2, "search": 3, "resolve": 4, "runtime": 5,
             "deepspeed": 6, "megatron": 6, "torch": 6, "profiler": 7, "commands": 8, "cli": 8}
    package = Path(__file__).resolve().parents[1] / "koala_ds"
    offenders = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).with_suffix("").parts
        if rel[0] not in level:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level:
                here = list(rel[:-1])
                full = here[: len(here) - (node.level - 1)] + (node.module.split(".") if node.module else [])
                target = full[0] if full else node.names[0].name
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("koala_ds."):
                target = node.module.split(".")[1]
            else:
                continue
            if target in level and level[target] > level[rel[0]]:
                offenders.append(f"{'/'.join(rel)} imports {target}")
    assert offenders == []

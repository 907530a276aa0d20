"""``python -m lowbit.bench [quantize|gemm|dense|grouped|moe|layer|attention|all] [--small|--full]
[--out DIR]``
``python -m lowbit.bench multi_device --stage {seed,layer,moe,all} ...`` (lowbit.bench.multi_device)

Times lowbit next to plain Flax/XLA in one process, prints tables, writes JSON (with the device
name and versions) and PNG charts under benchmarks/results/ (or --out). Small shapes on CPU.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from lowbit.bench.charts import CPU_TAG, backend_note, ratio_chart
from lowbit.bench.common import environment, on_gpu, print_table, write_json

SUITES = {
    "quantize": ("lowbit.bench.quantize", ["shape", "case", "ms", "GBps", "frac_of_copy"]),
    "gemm": ("lowbit.bench.gemm", ["shape", "format", "ms", "tflops", "vs_bf16", "vs_fp8"]),
    "dense": ("lowbit.bench.dense", None),
    "grouped": ("lowbit.bench.grouped", None),
    "moe": (
        "lowbit.bench.moe",
        ["name", "ms", "TFLOPs", "vs_xla", "vs_bf16", "floor_ms", "weight_GB", "weights", "note"],
    ),
    "layer": ("lowbit.bench.layer", ["model", "name", "ms", "speedup", "sm_mhz", "power_w", "note"]),
    "attention": ("lowbit.bench.attention", ["model", "name", "shape", "ms", "speedup", "goal"]),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["multi_device"]:
        # Its own arguments, and its own set-up before any jax backend starts (host devices,
        # jax.distributed): not one of the single-device suites.
        from lowbit.bench import multi_device

        return multi_device.main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m lowbit.bench", description=__doc__)
    ap.add_argument("suite", nargs="?", default="all", choices=["all", *SUITES])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--small", action="store_true", help="small shapes (default without a GPU)")
    size.add_argument("--full", action="store_true", help="the seed shapes (default on a GPU)")
    ap.add_argument("--out", default=os.environ.get("LOWBIT_BENCH_OUT", "benchmarks/results"))
    args = ap.parse_args(argv)
    small = args.small or (not args.full and not on_gpu())

    env = environment()
    note = backend_note(env["platform"])
    print(f"lowbit benchmark on {env['device']} (jax {env['jax']}, {'small' if small else 'full'} shapes)")
    if note:
        print(f"({note})")
    names = list(SUITES) if args.suite == "all" else [args.suite]
    suffix = "small" if small else "full"
    for name in names:
        module_name, columns = SUITES[name]
        try:
            mod = importlib.import_module(module_name)
        except ImportError as e:
            if args.suite == "all":
                print(f"(skipping {name}: {e})")
                continue
            raise
        total = mod.count(small) if hasattr(mod, "count") else None
        bar = _progress(name, total)
        rows = mod.run(small, progress=bar.update if bar else None) if total else mod.run(small)
        if bar:
            bar.close()
        cols = columns or list(rows[0].keys()) if rows else []
        print_table(table_title(name, env), rows, columns or cols)
        path = write_json(f"{name}-{suffix}", {"env": env, "rows": rows}, args.out)
        print(f"wrote {path}")
        for chart in _charts(name, rows, args.out, suffix, env["device"], note):
            print(f"wrote {chart}")
    return 0


def table_title(name: str, env: dict) -> str:
    """A suite's table heading: the device, and on the CPU that lowbit ran its reference kernels."""
    title = f"{name} ({env['device']})"
    return f"{title}: {CPU_TAG}" if env["platform"] == "cpu" else title


def _progress(name, total):
    if not total:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=name, file=sys.stderr, leave=False)


def _charts(name: str, rows: list, out: str, suffix: str, device: str, note: str | None = None) -> list:
    """One PNG per baseline: quantize against copy bandwidth, grouped GEMM against
    jax.lax.ragged_dot, dense/layer against each row's ``speedup_vs``; ``note`` as each chart's
    footnote."""
    if name == "quantize":
        rows = [dict(r, bar=r["case"]) for r in rows if not r["case"].startswith("copy")]
        specs = [("", rows, "fraction of copy bandwidth (copy = 1)", "frac_of_copy", "shape")]
    elif name == "gemm":
        rows = [dict(r, bar=r["format"]) for r in rows if r["format"] != "bf16"]
        specs = [("", rows, "speed-up over the BF16 GEMM", "vs_bf16", "shape")]
    elif name == "grouped":
        rows = [
            dict(r, bar=f"{r['sizes']} {r['pass']}: {r['case']}")
            for r in rows
            if r["case"] not in ("ragged_dot bf16", "dense bf16")
        ]
        specs = [("", rows, "speed-up over jax.lax.ragged_dot (bf16)", "speedup", "shape")]
    else:
        baselines = list(dict.fromkeys(r.get("speedup_vs") for r in rows if r.get("speedup_vs")))
        specs = []
        for i, base in enumerate(baselines):
            part = [
                dict(r, bar=r["name"])
                for r in rows
                if r.get("speedup_vs") == base and base not in (r["name"], r["name"].split(": ")[-1])
            ]
            tag = "" if i == 0 else "-vs-" + "-".join(base.replace(".", "").replace(":", "").split())
            specs.append((tag, part, f"speed-up over {base}", "speedup", "model"))
    paths = []
    for tag, part, xlabel, value, group in specs:
        path = ratio_chart(
            os.path.join(out, f"{name}{tag}-{suffix}.png"),
            part,
            f"{name} on {device}" + (f" ({CPU_TAG})" if note else ""),
            xlabel,
            value=value,
            group=group,
            label="bar",
            note=note,
        )
        if path:
            paths.append(path)
    return paths


if __name__ == "__main__":
    sys.exit(main())

"""Cold start: ``python -m nbgen.bench.cold_start --model DIR --load-format dummy``.

A child process with an empty Triton cache (``--fresh-triton-cache``, the default; flashinfer's JIT
cache is left as it is) times ``import nbgen``, the first ``Engine`` (its ``startup_s`` phases), a
short generate, and a second ``Engine`` in the same process after the first one's shutdown. Then the
Triton kernels compiled on the way are counted by name (the variants a first start pays for).
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import nbgen
t1 = time.perf_counter()
kw = json.loads(sys.argv[1])
eng = nbgen.Engine(**kw)
t2 = time.perf_counter()
first = eng.get_server_info()["startup_s"]
eng.generate(input_ids=[[5] * 100] * 4, sampling_params={"max_new_tokens": 8, "temperature": 0.7})
t3 = time.perf_counter()
eng.shutdown()
t4 = time.perf_counter()
eng = nbgen.Engine(**kw)
t5 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "first_engine_s": t2 - t1, "first_startup_s": first,
                  "first_generate_s": t3 - t2, "second_engine_s": t5 - t4,
                  "second_startup_s": eng.get_server_info()["startup_s"]}))
eng.shutdown()
"""


def triton_variants(cache: str) -> collections.Counter:
    """Compiled Triton kernels in a cache directory, counted by kernel name."""
    names: collections.Counter = collections.Counter()
    for f in glob.glob(os.path.join(cache, "*", "*.json")):
        if os.path.basename(f).startswith("__grp__"):
            continue
        try:
            with open(f) as fh:
                names[json.load(fh).get("name", os.path.basename(f))] += 1
        except (OSError, ValueError):
            continue
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF dir (config.json); default: the embedded model")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--keep-triton-cache", action="store_true", help="use the user's Triton cache (a warm start)")
    args = ap.parse_args()
    kw = {"model_path": args.model, "load_format": args.load_format, "device": args.device}
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as cache:
        if not args.keep_triton_cache:
            env["TRITON_CACHE_DIR"] = cache
        out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(kw)], env=env, check=True,
                             capture_output=True, text=True)
        res = json.loads(out.stdout.strip().splitlines()[-1])
        variants = triton_variants(env.get("TRITON_CACHE_DIR", cache))
    print(f"import nbgen {res['import_s']:.1f} s, first Engine {res['first_engine_s']:.1f} s "
          f"{res['first_startup_s']}, first generate {res['first_generate_s']:.1f} s")
    print(f"second Engine (same process, after shutdown) {res['second_engine_s']:.1f} s {res['second_startup_s']}")
    if not args.keep_triton_cache:
        print(f"Triton variants compiled: {sum(variants.values())}")
        for name, n in variants.most_common(12):
            print(f"{n:5d}  {name}")


if __name__ == "__main__":
    main()

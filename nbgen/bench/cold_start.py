"""Cold start: ``python -m nbgen.bench.cold_start --model DIR --load-format dummy [--fresh-flashinfer-cache]``.

A child process with an empty Triton cache (the default; ``--keep-triton-cache`` keeps the user's) times
``import nbgen``, the first ``Engine`` (its ``startup_s`` phases), a short generate, and a second
``Engine`` in the same process after the first one's shutdown. Then the Triton kernels compiled on the
way are counted by name (the variants a first start pays for). ``--fresh-flashinfer-cache`` also gives
the child an empty ``FLASHINFER_WORKSPACE_BASE`` (a fresh host: every flashinfer JIT module compiles)
and prints each module built: the thread that built it (the engine's loop, or the start-up's
background prebuild, runtime/jit_prebuild.py), when it started after ``Engine(...)`` and its seconds.
The Triton variants compiled in the engine's own process (not by the start-up's precompile workers,
kernels/triton_precompile.py) are listed by phase, thread and kernel.
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
import json, sys, threading, time
t0 = time.perf_counter()
import nbgen
t1 = time.perf_counter()
kw = json.loads(sys.argv[1])
builds = []
try:   # time every flashinfer JIT build (ninja; a no-op when its outputs are up to date)
    import flashinfer.jit.core as fjc
    _build = fjc.JitSpecNvcc.build
    def _timed(self, *a, **k):
        s = time.perf_counter()
        try:
            return _build(self, *a, **k)
        finally:
            builds.append((self.name, threading.current_thread().name, s - t1, time.perf_counter() - s))
    fjc.JitSpecNvcc.build = _timed
except (ImportError, AttributeError):
    pass
phase = ["first Engine"]
compiled = []   # Triton variants compiled in this process (not found in the cache): phase, thread, kernel
try:
    from triton import knobs
    def _listen(*, src, metadata, cache_hit, **_):
        if not cache_hit:
            compiled.append((phase[0], threading.current_thread().name, metadata.get("name", "?")))
    knobs.compilation.listener = _listen
except (ImportError, AttributeError):
    pass
eng = nbgen.Engine(**kw)
t2 = time.perf_counter()
first = eng.get_server_info()["startup_s"]
phase[0] = "first generate"
eng.generate(input_ids=[[5] * 100] * 4, sampling_params={"max_new_tokens": 8, "temperature": 0.7})
t3 = time.perf_counter()
phase[0] = "second Engine"
eng.shutdown()
t4 = time.perf_counter()
eng = nbgen.Engine(**kw)
t5 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "first_engine_s": t2 - t1, "first_startup_s": first,
                  "first_generate_s": t3 - t2, "second_engine_s": t5 - t4,
                  "second_startup_s": eng.get_server_info()["startup_s"]}))
eng.shutdown()
for t in threading.enumerate():   # the background flashinfer builds still running: waited for, to report them
    if t.name == "nbgen-jit-prebuild":
        t.join(600)
print(json.dumps({"builds_done_s": time.perf_counter() - t1, "jit_builds": builds, "in_process": compiled}))
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
    ap.add_argument("--fresh-flashinfer-cache", action="store_true",
                    help="an empty flashinfer JIT cache too (FLASHINFER_WORKSPACE_BASE): a fresh host")
    args = ap.parse_args()
    kw = {"model_path": args.model, "load_format": args.load_format, "device": args.device}
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as fi_base:
        if not args.keep_triton_cache:
            env["TRITON_CACHE_DIR"] = cache
        if args.fresh_flashinfer_cache:
            env["FLASHINFER_WORKSPACE_BASE"] = fi_base
        out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(kw)], env=env, check=True,
                             capture_output=True, text=True)
        lines = out.stdout.strip().splitlines()
        res = json.loads(lines[-2])
        res.update(json.loads(lines[-1]))
        variants = triton_variants(env.get("TRITON_CACHE_DIR", cache))
    print(f"import nbgen {res['import_s']:.1f} s, first Engine {res['first_engine_s']:.1f} s "
          f"{res['first_startup_s']}, first generate {res['first_generate_s']:.1f} s")
    print(f"second Engine (same process, after shutdown) {res['second_engine_s']:.1f} s {res['second_startup_s']}")
    slow = [b for b in res["jit_builds"] if b[3] >= 0.5]
    print(f"background flashinfer builds done {res['builds_done_s']:.1f} s after Engine(...) was called")
    print(f"flashinfer JIT builds: {len(slow)} compiled, {len(res['jit_builds']) - len(slow)} up to date (< 0.5 s)")
    for name, thread, start, secs in sorted(slow, key=lambda b: b[2]):
        print(f"  {secs:6.1f} s  from +{start:5.1f} s  {thread:22s} {name}")
    if not args.keep_triton_cache:
        print(f"Triton variants compiled: {sum(variants.values())}")
        for name, n in variants.most_common(12):
            print(f"{n:5d}  {name}")
    inproc = collections.Counter((p, t, n) for p, t, n in res["in_process"])
    print(f"of them compiled in the engine's process (the rest by the precompile's workers): {sum(inproc.values())}")
    for (p, t, n), k in sorted(inproc.items()):
        print(f"{k:5d}  {p:15s} {t:22s} {n}")


if __name__ == "__main__":
    main()

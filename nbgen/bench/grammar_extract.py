"""The realistic structured-output workload of ``nbgen.bench.grammar``: record extraction.

N short profiles (name, age, city, employer, role, skills, ...) are turned into JSON by a nested
schema (objects, an array, enums, integers and a number) with greedy decoding and no ``ignore_eos``:
a request ends when its grammar completes (or at max_new_tokens). Every output is validated against
the schema (``schema_check``, no jsonschema package needed). Run with and without jump-forward
decoding on one engine, alternately, ``repeats`` times each.
"""
from __future__ import annotations

import json
import statistics
import time
from typing import Any, Callable, Optional

from nbgen.bench.phases import PhaseTimer
from nbgen.bench.profiling import StepTimer
from nbgen.bench.schema_check import schema_errors

NAMES = ["Maria Lopez", "Kenji Sato", "Amara Okafor", "Lukas Becker", "Priya Nair", "Tom Walsh", "Ines Duarte",
         "Omar Haddad", "Sofia Rossi", "Chen Wei", "Freya Nilsen", "Diego Ruiz", "Hana Kim", "Ivan Petrov"]
CITIES = [("Lyon", "France"), ("Osaka", "Japan"), ("Lagos", "Nigeria"), ("Hamburg", "Germany"),
          ("Kochi", "India"), ("Cork", "Ireland"), ("Porto", "Portugal"), ("Beirut", "Lebanon")]
EMPLOYERS = ["Acme Corp", "Northwind", "Globex", "Initech", "city hospital", "the public school", "Umbrella Labs"]
ROLES = ["engineer", "teacher", "nurse", "manager", "artist", "other"]
SKILLS = ["python", "sql", "welding", "painting", "first aid", "statistics", "french", "negotiation", "excel"]
STATUS = ["active", "retired", "student"]

SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "age", "address", "job", "skills", "status", "rating"],
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object", "additionalProperties": False, "required": ["city", "country"],
                    "properties": {"city": {"type": "string", "maxLength": 30},
                                   "country": {"type": "string", "maxLength": 30}}},
        "job": {"type": "object", "additionalProperties": False, "required": ["employer", "role", "since"],
                "properties": {"employer": {"type": "string", "maxLength": 30},
                               "role": {"type": "string", "enum": ROLES},
                               "since": {"type": "integer", "minimum": 1950, "maximum": 2030}}},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
        "status": {"type": "string", "enum": STATUS},
        "rating": {"type": "number", "minimum": 0, "maximum": 5},
    }}


def profiles(n: int) -> list[str]:
    """n short free-text profiles (deterministic)."""
    out = []
    for i in range(n):
        name, (city, country) = NAMES[i % len(NAMES)], CITIES[(i * 3) % len(CITIES)]
        skills = ", ".join(SKILLS[(i + k) % len(SKILLS)] for k in range(1 + i % 3))
        out.append(f"{name} ({20 + (i * 7) % 50}) lives in {city}, {country}. Works at "
                   f"{EMPLOYERS[i % len(EMPLOYERS)]} as a {ROLES[i % 5]} since {1990 + i % 30}. "
                   f"Skills: {skills}. Currently {STATUS[i % 3]}; rated {(i % 10) / 2:.1f} of 5.")
    return out


def prompts(eng: Any, n: int) -> list[str]:
    return [eng.apply_chat_template([{"role": "user", "content": f"Extract the person's record as JSON.\n{p}"}])
            for p in profiles(n)]


def check(outs: list[dict]) -> dict[str, int]:
    """How many outputs completed the grammar, and how many of those are valid against SCHEMA."""
    done = [o for o in outs if o["meta_info"]["finish_reason"]["type"] == "stop"]
    valid = 0
    for o in done:
        try:
            valid += not schema_errors(json.loads(o["text"]), SCHEMA)
        except json.JSONDecodeError:
            pass
    return {"n": len(outs), "complete": len(done), "valid": valid}


def run(eng: Any, n: int, max_new_tokens: int, repeats: int,
        profile: Optional[Callable[[Any, list[str], dict[str, Any], str, StepTimer], None]] = None,
        chunks: bool = False, phases: bool = False) -> dict[str, Any]:
    """Alternate runs with and without jump-forward (the engine must have been built with
    ``enable_jump_forward=True``; the switch is the grammar service's jumper). Prints each run.
    ``profile(eng, prompts, sampling params, label, step timer)``: one more run of each kind under it.
    ``chunks``: a third kind, jump-forward with its forced tokens computed as chunks (mixed steps)
    instead of decode rows (``SchedulerConfig.forced_token_rows`` 0; runtime/forced_rows.py).
    ``phases``: each run also prints its host time per step by phase (bench/phases.py)."""
    sp = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "json_schema": json.dumps(SCHEMA)}
    ps = prompts(eng, n)
    eng.generate(ps[:4], {**sp, "max_new_tokens": 8}, use_tqdm=False)   # compile the schema
    service = eng.loop.delivery.grammar
    jumper = service.jumper
    if jumper is None:
        raise ValueError("the realistic workload needs an engine built with enable_jump_forward=True")
    sched = eng.loop.scheduler
    forced_rows = sched.cfg.forced_token_rows
    timer = StepTimer(eng)
    phase = PhaseTimer(eng) if phases else None
    rows: dict[str, list] = {"token_by_token": [], "jump_forward": []}
    if chunks:
        rows["jump_forward_chunks"] = []

    def switch(kind: str) -> None:    # loop thread
        service.jumper = None if kind == "token_by_token" else jumper
        sched.cfg.forced_token_rows = 0 if kind == "jump_forward_chunks" else forced_rows
    try:
        for _ in range(repeats):
            for kind in rows:
                eng.loop.call(lambda: switch(kind))
                timer.reset()
                if phase is not None:
                    phase.reset()
                j0, t0 = jumper.num_tokens, time.perf_counter()
                outs = eng.generate(ps, sp, use_tqdm=False)
                secs = time.perf_counter() - t0
                r = {"seconds": secs, "out_tokens": sum(o["meta_info"]["completion_tokens"] for o in outs),
                     "jumped_tokens": jumper.num_tokens - j0, **check(outs), **timer.summary()}
                rows[kind].append(r)
                print(f"extract {kind:19s} {secs:7.2f} s  {r['out_tokens']:6d} out tokens "
                      f"({r['jumped_tokens']} jumped)  {r['valid']}/{n} valid ({r['complete']} complete)  "
                      f"{r['steps']} steps, {r['step_ms']:.2f} ms/step, host {r['host_ms']:.2f} ms/step",
                      flush=True)
                if phase is not None:
                    print(f"extract {kind:19s} {phase.line(r['steps'])}", flush=True)
        for kind in rows if profile is not None else ():
            eng.loop.call(lambda: switch(kind))
            profile(eng, ps, sp, f"extract {kind}", timer)
    finally:
        eng.loop.call(lambda: switch("jump_forward"))
        if phase is not None:
            phase.close()
        timer.close()
    med = {k: statistics.median(r["seconds"] for r in v) for k, v in rows.items()}
    ratio = med["jump_forward"] / med["token_by_token"]
    print(f"extract: jump-forward / token-by-token time, median of {repeats}: {ratio:.3f}")
    if chunks:
        print(f"extract: jump-forward as chunks / token-by-token: "
              f"{med['jump_forward_chunks'] / med['token_by_token']:.3f}")
    return {"runs": rows, "median_s": med, "ratio": ratio}

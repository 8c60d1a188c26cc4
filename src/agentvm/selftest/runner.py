"""Selecting, running and reporting selftest cases."""

from __future__ import annotations

import json
import time

from agentvm.selftest.framework import CATEGORIES, WEAKENINGS, Env, all_cases, run_cases


def select(categories: tuple[str, ...] = (), ids: tuple[str, ...] = ()):
    cases = all_cases()
    if categories:
        unknown = set(categories) - set(CATEGORIES)
        if unknown:
            from agentvm.errors import ConfigError

            raise ConfigError(f"unknown category {', '.join(sorted(unknown))}", hint="one of: " + ", ".join(CATEGORIES))
        cases = [c for c in cases if c.category in categories]
    if ids:
        cases = [c for c in cases if c.id in ids]
    return cases


def run(categories=(), ids=(), weaken: str = "none", keep: bool = False, substrate: str = "bwrap",
        image: str | None = None) -> dict:
    cases = select(categories, ids)
    t0 = time.monotonic()
    env = Env(weaken=weaken, keep=keep, substrate=substrate, image=image)
    try:
        results = run_cases(cases, env)
    finally:
        env.close()
    counts: dict[str, dict[str, int]] = {}
    for r in results:
        c = counts.setdefault(r["category"], {"contained": 0, "escaped": 0, "error": 0, "n/a": 0})
        c[r["status"]] += 1
    return {
        "weaken": weaken,
        "substrate": substrate,
        "image": env.image,
        "total": len(results),
        "applicable": sum(r["status"] != "n/a" for r in results),
        "not_applicable": sum(r["status"] == "n/a" for r in results),
        "contained": sum(r["status"] == "contained" for r in results),
        "escaped": sum(r["status"] == "escaped" for r in results),
        "errors": sum(r["status"] == "error" for r in results),
        "seconds": round(time.monotonic() - t0, 1),
        "by_category": counts,
        "results": results,
    }


def markdown() -> str:
    """docs/security-tests.md, generated from the case list (`agentvm selftest --list --markdown`)."""
    lines = [
        "# Security tests (`agentvm selftest`)",
        "",
        "Generated from the suite's own case list by `agentvm selftest --list --markdown`; do not edit.",
        "",
        "Each case runs real hostile code in a real sandbox on *this* host, with canaries (fake",
        "credentials in a private vault, canary files outside every grant, a local sink that records",
        "anything reaching it). A case reports **contained**, **escaped** (with evidence) or",
        "**error**; `agentvm selftest` exits non-zero on any escape or error. Every case names the",
        "weakening under which it must report *escaped*; the test suite runs each case that way,",
        "proving it can fail.",
        "",
    ]
    cases = all_cases()
    lines.append(f"{len(cases)} cases in {len({c.category for c in cases})} categories.")
    lines.append("")
    for cat in CATEGORIES:
        cs = [c for c in cases if c.category == cat]
        if not cs:
            continue
        lines += [f"## {cat} ({len(cs)})", "", "| id | attack | must escape when |", "|---|---|---|"]
        for c in cs:
            why = " and ".join(WEAKENINGS[w] for w in c.weakened_by.split("+"))
            na = "".join(f"<br>n/a on {s}: {r}" for s, r in sorted(c.not_on.items()))
            lines.append(f"| `{c.id}` | {c.title}{na} | {why} (`{c.weakened_by}`) |")
        lines.append("")
    return "\n".join(lines)


def render_text(report: dict) -> str:
    out = []
    for r in report["results"]:
        mark = {"contained": " ok ", "escaped": "ESCAPED", "error": "ERROR", "n/a": "n/a "}[r["status"]]
        out.append(f"[{mark}] {r['id']:<40} {r['title']}")
        if r["status"] == "n/a":
            out.append(f"         {r['evidence'][:400]}")
        elif r["status"] != "contained":
            out.append(f"         evidence: {r['evidence'][:400]}")
    out.append("")
    out.append(f"{'category':<14} contained escaped error  n/a")
    for cat, c in report["by_category"].items():
        out.append(f"{cat:<14} {c['contained']:>9} {c['escaped']:>7} {c['error']:>5} {c['n/a']:>4}")
    out.append(f"substrate {report['substrate']}: {report['applicable']} applicable cases: {report['contained']} contained, "
               f"{report['escaped']} escaped, {report['errors']} errors; {report['not_applicable']} not applicable; "
               f"{report['seconds']} s"
               + (f" (WEAKENED: {report['weaken']})" if report["weaken"] != "none" else ""))
    return "\n".join(out)


def to_json(report: dict) -> str:
    return json.dumps(report, indent=2, sort_keys=True)

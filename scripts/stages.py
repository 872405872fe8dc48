#!/usr/bin/python3
"""The test command's time, stage by stage: scripts/stages.py OUT

Reads what scripts/test.sh and scripts/kernel_matrix.py left in OUT: stages.tsv (a
stage's name and the wall clock when it ended, from `mark` in test.sh), host.xml
and host-e2e.xml (the host's pytest; its time split by tier: tests/unit, tests/kernel,
tests/e2e; the host's tests, when they ran beside the guests (mark e2e), rows of their own,
the unit tests' wall clock from host-unit.took; the unit tests, when they ran on their own
two at a time, are the stage host-unit's wall clock)
and guests.tsv (per guest: seconds to boot, seconds in all, and the wall clock
when it booted: guests run two at a time, so their rows overlap and the
matrix's own work is its time outside every guest). Prints a markdown table of
the stages and the total."""
import os
import sys
import xml.etree.ElementTree as ET


def tiers(junit):
    """{tier: seconds} of the host's tests, by the directory under tests/."""
    out = {}
    for case in ET.parse(junit).iter("testcase"):
        parts = case.get("classname", "").split(".")
        tier = parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"
        out[tier] = out.get(tier, 0.0) + float(case.get("time") or 0)
    return out


def _host_tiers(out, beside):
    """{tier: seconds} of the host's pytest runs before the guests: host.xml,
    and host-e2e.xml unless the e2e tests ran beside the guests."""
    split = {}
    for name in ("host.xml",) + (() if beside else ("host-e2e.xml",)):
        junit = os.path.join(out, name)
        for tier, sec in (tiers(junit) if os.path.exists(junit) else {}).items():
            split[tier] = split.get(tier, 0.0) + sec
    return split


def _covered(spans):
    """Seconds covered by the guests' runs ((start, seconds); a start of None,
    from an older guests.tsv, counts as one after the other)."""
    if any(start is None for start, _ in spans):
        return sum(t for _, t in spans)
    covered, end = 0.0, None
    for start, t in sorted(spans):
        lo = start if end is None else max(start, end)
        if start + t > lo:
            covered += start + t - lo
        end = start + t if end is None else max(end, start + t)
    return covered


def rows(out):
    marks = []
    with open(os.path.join(out, "stages.tsv")) as f:
        for line in f:
            name, _, t = line.rstrip("\n").partition("\t")
            marks.append((name, float(t)))
    guests = []
    if os.path.exists(os.path.join(out, "guests.tsv")):
        with open(os.path.join(out, "guests.tsv")) as f:
            guests = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    table = []
    for (_, t0), (name, t1) in zip(marks, marks[1:]):
        took = t1 - t0
        if name == "set-up":
            table.append(("set-up (Debian packages, virtualenv)", took))
        elif name == "checks":
            table.append(("BPF objects and rendered mixin fresh", took))
        elif name == "host-unit":          # pytest-xdist's two workers: the wall clock, not the tests' sum
            table.append(("host: unit tests, two at a time", took))
        elif name == "host":
            split = _host_tiers(out, beside=any(n == "e2e" for n, _ in marks))
            for tier in ("unit", "kernel", "e2e"):
                if tier in split:
                    table.append((f"host: {tier} tests", split[tier]))
            table.append(("host: pytest start, collection, the rest", took - sum(split.values())))
        elif name == "e2e":                 # they ran beside the guests: inside the matrix's time
            unit = os.path.join(out, "host-unit.took")
            if os.path.exists(unit):         # the unit tests' wall clock (two at a time), before the others
                with open(unit) as f:
                    table.append(("host: unit tests, two at a time, beside the guests", float(f.read())))
            host = os.path.join(out, "host.xml")
            if not any(n == "host" for n, _ in marks) and os.path.exists(host):   # and the kernel tests
                table.append(("host: kernel tests, beside the guests", tiers(host).get("kernel", 0.0)))
            junit = os.path.join(out, "host-e2e.xml")
            table.append(("host: e2e tests, beside the guests", tiers(junit).get("e2e", 0.0)
                          if os.path.exists(junit) else 0.0))
            table.append(("host: e2e tests, waited for after the guests", took))
        elif name == "matrix":
            spans = []
            for g, boot, total, *began in guests:
                total = float(total)
                start = float(began[0]) if began and began[0] else None
                spans.append((start, total))
                cpu = f" (the host's CPU: {float(began[1]):.0f} s)" if len(began) > 1 and began[1] else ""
                if boot:
                    table.append((f"guest {g}: boot", float(boot)))
                    table.append((f"guest {g}: tests{cpu}", total - float(boot)))
                else:
                    table.append((f"guest {g}: did not report its boot", total))
            inside = _covered(spans)
            if len(guests) > 1 and inside < sum(t for _, t in spans):
                table.append(("guests, wall clock (they overlap)", inside))
            table.append(("kernel matrix: fetch, install, report", took - inside))
        else:
            table.append((name, took))
    return table, marks[-1][1] - marks[0][1]


def main():
    table, total = rows(sys.argv[1])
    print("| stage | seconds |\n|---|---:|")
    for name, sec in table:
        print(f"| {name} | {sec:.0f} |")
    print(f"| **total** | **{total:.0f}** ({total / 60:.1f} min) |")


if __name__ == "__main__":
    main()

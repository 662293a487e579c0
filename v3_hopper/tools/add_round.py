#!/usr/bin/env python3
"""Prints the JSON rows of a timing tool's output with "round" set: the A/B scripts (ab_v3.sh, ab_value.sh,
ab_split.sh) append each run's rows to one file this way.
    python3 add_round.py rows.jsonl ROUND >> all.jsonl
"""
import json
import sys


def main() -> None:
    path, round_ = sys.argv[1], int(sys.argv[2])
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                row["round"] = round_
                print(json.dumps(row))


if __name__ == "__main__":
    main()

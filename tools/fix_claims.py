"""Re-point docs/claims.md's places after an edit moved the lines they cite: every row that
tests/test_claims.py::test_claims_quotes_are_in_their_files finds at another line is rewritten to the line it names
(a LINE-END place keeps its length, or takes the end the test names). Quotes that are no longer in their file are
listed, not touched: a reworded sentence needs its row read again.

    python tools/fix_claims.py
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from tests.test_claims import CLAIMS, claim_problems  # noqa: E402

MOVED = re.compile(r"docs/claims\.md:(\d+): (\S+?):(\d+)(?:-(\d+))? should be \S+?:(\d+)(?:-(\d+))?"
                   r"(?: \(the quote ends at line (\d+)\))?")


def main() -> None:
    for _ in range(5):  # a row with several places is fixed one place a pass
        _, problems = claim_problems()
        lines, fixed, left = CLAIMS.read_text().split("\n"), 0, []
        for problem in problems:
            m = MOVED.match(problem)
            if not m:
                left.append(problem)
                continue
            number, path, start, end, new_start, new_end, quote_end = m.groups()
            old = f"{path}:{start}" + (f"-{end}" if end else "")
            if new_end:  # the place's end: where its last quote ends
                new = f"{path}:{new_start}-{new_end}"
            elif end:  # a LINE-END place moved: it keeps its length, or reaches the quote's end
                new = f"{path}:{new_start}-{max(int(new_start) + int(end) - int(start), int(quote_end or 0))}"
            else:
                new = f"{path}:{new_start}"
            row = lines[int(number) - 1]
            lines[int(number) - 1] = re.sub(  # in the path's list of places (grpo.py:217-218, 680)
                rf"{re.escape(path)}:[0-9, -]+", lambda places: re.sub(
                    rf"(?<![0-9]){re.escape(old.split(':')[1])}(?![0-9])", new.split(":")[1], places.group(0), count=1),
                row, count=1)
            fixed += lines[int(number) - 1] != row
        CLAIMS.write_text("\n".join(lines))
        if not fixed:
            break
    _, problems = claim_problems()
    print("\n".join(problems) if problems else "docs/claims.md: every quote where its row says")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()

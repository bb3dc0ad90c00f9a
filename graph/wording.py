"""How messages and reports word counts and lists of names, so that every layer says them alike.

- `count(1, "epoch")` is "1 epoch", `count(3, "epoch")` "3 epochs", `count(2, "batch")` "2 batches": a
  count agrees with its noun (a phrase whose plural is not the noun's gives it: `count(n, "folder
  inside a class folder", "folders inside class folders")`).
- `name_list(names)` joins names with commas; a long list (MobileNetV2 has 262 parameters) shows its
  first and last SHOWN_AT_EACH_END names around "... N more ...", with the caller's hint on how to see
  them all (the command line's "--verbose lists all").
"""
from __future__ import annotations

SHOWN_AT_EACH_END = 3


def count(number: int, noun: str, plural: str | None = None) -> str:
    """'1 batch', '2 batches', '1,024 parameters': the number with thousands separators, the noun agreeing."""
    if number == 1:
        return f"1 {noun}"
    if plural is None:
        plural = noun + ("es" if noun.endswith(("s", "sh", "tch", "x", "z")) else "s")  # batches, epochs
    return f"{number:,} {plural}"


def name_list(names: list[str], complete: bool = False, hint: str = "") -> str:
    """The names, comma-separated; unless `complete`, a long list as its first and last few around a count."""
    if complete or len(names) <= 2 * SHOWN_AT_EACH_END + 1:
        return ", ".join(names)
    hidden = len(names) - 2 * SHOWN_AT_EACH_END
    return ", ".join(names[:SHOWN_AT_EACH_END] + [f"... {hidden} more{f' ({hint})' if hint else ''} ..."]
                     + names[-SHOWN_AT_EACH_END:])

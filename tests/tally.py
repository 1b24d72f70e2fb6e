"""The count every test script keeps and prints last, "NAME: N passed, N failed", which
scripts/test.sh adds up."""
import sys

passed = failed = skipped = 0


def check(ok, what):
    global passed, failed
    if ok:
        passed += 1
    else:
        failed += 1
        print("FAIL:", what, flush=True)


def skip(what, why):
    """A check that cannot run here: said, counted as skipped, never as passed."""
    global skipped
    skipped += 1
    print(f"SKIP: {what} ({why})", flush=True)


def finish(name):
    print(f"{name}: {passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
    sys.exit(1 if failed else 0)

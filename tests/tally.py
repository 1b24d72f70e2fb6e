"""The count every test script keeps and prints last, "NAME: N passed, N failed", which
scripts/test.sh adds up."""
import sys

passed = failed = 0


def check(ok, what):
    global passed, failed
    if ok:
        passed += 1
    else:
        failed += 1
        print("FAIL:", what, flush=True)


def finish(name):
    print(f"{name}: {passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)

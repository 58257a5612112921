"""Prints `N passed, N failed, N skipped` from the build event (JSON) file of a `bazel test`.

    summarize_bep.py BEP.json ["PASSED|FAILED NAME"...]
Counts test targets: passed when Bazel's summary says PASSED or FLAKY, skipped when Bazel skipped
the target (incompatible with this machine), failed otherwise, including a target that failed to
build. Each further argument is a check run besides the tests (.ci/run's), counted as it says.
Exits 1 if anything failed or the build did not finish successfully.
"""

import json
import sys


def summarize(events):
    status, skipped, broken, exit_code = {}, set(), set(), None
    for event in events:
        ident = event.get("id", {})
        if "testSummary" in ident:
            label = ident["testSummary"]["label"]
            if "aborted" in event:
                reason = event["aborted"].get("reason", "ABORTED")
                if reason == "SKIPPED":
                    skipped.add(label)
                else:
                    status[label] = reason
            else:
                status[label] = event.get("testSummary", {}).get("overallStatus", "NO_STATUS")
        elif "targetCompleted" in ident:
            label = ident["targetCompleted"]["label"]
            if event.get("aborted", {}).get("reason") == "SKIPPED":
                skipped.add(label)
            elif not event.get("completed", {}).get("success", True) or "aborted" in event:
                broken.add(label)
        elif "buildFinished" in ident:
            exit_code = event.get("finished", {}).get("exitCode", {}).get("name", "SUCCESS")
    passed = sorted(label for label, s in status.items() if s in ("PASSED", "FLAKY"))
    failed = sorted(f"{label} {s}" for label, s in status.items() if s not in ("PASSED", "FLAKY"))
    failed += sorted(f"{label} FAILED_TO_BUILD" for label in broken - status.keys())
    if exit_code != "SUCCESS" and not failed:
        failed.append(f"bazel exited with {exit_code}")
    return passed, failed, sorted(skipped)


def main():
    with open(sys.argv[1]) as f:
        passed, failed, skipped = summarize(json.loads(line) for line in f if line.strip())
    for check in sys.argv[2:]:
        status, name = check.split(" ", 1)
        (passed if status == "PASSED" else failed).append(name)
    for line in failed:
        print("FAILED:", line)
    print(f"{len(passed)} passed, {len(failed)} failed, {len(skipped)} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

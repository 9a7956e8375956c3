"""The benchmark harness behind bench/run: configuration, runners, ledger, figures, report."""

"""python -m batchrnn.report, and batchrnn.report.write_report: the study report (batchrnn.study.report)."""
from batchrnn.study.report import write_report

__all__ = ["write_report"]

if __name__ == "__main__":
    from batchrnn.study.report.__main__ import main

    main()

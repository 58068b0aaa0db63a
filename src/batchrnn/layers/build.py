"""python -m batchrnn.layers.build [-v] [--allow-fallback]: build the CPU kernels now, not in a run's first step: the
CPU GRU's (oneDNN) and the conv front end's. `make venv` runs it; --allow-fallback exits 0 where one cannot be built
(that part then runs torch's operations, with a warning)."""
import sys

from batchrnn.layers import cpu_front_end, cpu_gru


def main(argv: list[str]) -> int:
    failed = 0
    for module in (cpu_gru, cpu_front_end):
        try:
            module.build(verbose="-v" in argv)
        except Exception as e:
            print(f"batchrnn: could not build the {module.WHAT}: {e}\nWithout it {module.INSTEAD}. Fix: {module.FIX}.",
                  file=sys.stderr)
            failed += 1
            continue
        print(f"batchrnn: {module.WHAT} built in {module.build_directory()}")
    return 0 if not failed or "--allow-fallback" in argv else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

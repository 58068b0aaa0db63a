"""python -m batchrnn.layers.build [-v] [--allow-fallback]: build the CPU GRU's oneDNN kernel now, not in a run's
first step. `make venv` runs it; --allow-fallback exits 0 where it cannot be built (the GRU then runs torch's
kernel, with a warning)."""
import sys

from batchrnn.layers.cpu_gru import FIX, build, build_directory, kernel_name


def main(argv: list[str]) -> int:
    try:
        build(verbose="-v" in argv)
    except Exception as e:
        print(f"batchrnn: could not build the oneDNN CPU GRU kernel: {e}\nThe CPU GRU will run torch's step loop "
              f"(about 2x slower). Fix: {FIX}.", file=sys.stderr)
        return 0 if "--allow-fallback" in argv else 1
    print(f"batchrnn: CPU GRU kernel {kernel_name()} built in {build_directory()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

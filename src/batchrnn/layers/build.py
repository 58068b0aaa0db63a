"""python -m batchrnn.layers.build [-v] [--allow-fallback]: build the CPU kernels now, not in a run's first step: the
CPU GRU's (oneDNN) and the conv front end's. `make venv` runs it; --allow-fallback exits 0 where one cannot be built
(that part then runs torch's operations, with a warning)."""
import sys

from batchrnn.layers import cpu_front_end, cpu_gru

KERNELS = {  # the module, and what runs instead where it cannot be built
    "CPU GRU kernel (oneDNN)": (cpu_gru, "the CPU GRU will run torch's step loop (about 2x slower)"),
    "conv front end's CPU kernel": (cpu_front_end, "the front end's BatchNorm will run torch's operations"),
}


def main(argv: list[str]) -> int:
    failed = 0
    for what, (module, instead) in KERNELS.items():
        try:
            module.build(verbose="-v" in argv)
        except Exception as e:
            print(f"batchrnn: could not build the {what}: {e}\n{instead[0].upper() + instead[1:]}. Fix: {module.FIX}.",
                  file=sys.stderr)
            failed += 1
            continue
        print(f"batchrnn: {what} built in {module.build_directory()}")
    return 0 if not failed or "--allow-fallback" in argv else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""experiments/bench_rnn.py: a CPU run gives every row and says nothing about CUDA."""
import importlib.util
import json

from conftest import BENCH_ROWS, ROOT

spec = importlib.util.spec_from_file_location("bench_rnn", ROOT / "experiments" / "bench_rnn.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_quick_cpu_run_gives_every_row_and_no_cuda_noise(capfd):
    bench.main(["--quick", "--rnn", "gru", "--device", "cpu"])
    out, err = capfd.readouterr()
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    # read from conftest's written-out list, not from bench.VARIANTS: a variant dropped from the bench fails here
    assert [(r["bn"], r["impl"]) for r in rows] == BENCH_ROWS
    assert all(r["ms"] > 0 and r["peak_mb"] > 0 for r in rows)
    assert err.startswith("bench: ") and err.count("\n") == 1, err  # its time estimate, nothing else


def test_kernels_prints_the_gru_lstm_ratio_and_gflops_at_each_thread_count(capfd):
    bench.main(["--kernels", "--quick", "--thread-list", "1,2"])
    out, _ = capfd.readouterr()
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(r["threads"], r["rnn"], r["bn"]) for r in rows] == [
        (t, rnn, bn) for t in (1, 2) for rnn, bn in
        [("gru", "none"), ("lstm", "none"), ("gru", "seqwise"), ("lstm", "seqwise"), ("gru-torch", "none")]]
    for r in rows:
        assert r["ms"] > 0 and 0 < r["gflops"] and r["gemm_gflops"] > 0
        lstm = next(x for x in rows if (x["threads"], x["rnn"], x["bn"]) == (r["threads"], "lstm", r["bn"]))
        assert abs(r["ratio_to_lstm"] - r["ms"] / lstm["ms"]) < 1e-2  # ms is rounded to 0.01
    assert "GRU kernel onednn lbr_gru" in out

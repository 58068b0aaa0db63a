"""What decoding with the word LM costs: a trained run's test split decoded greedily and with the LM's beam search at
each beam size, as seconds per utterance and as a ratio to greedy, and the whole tuning of one model at the default
beam (emissions of validation and test, the grid's points on validation, then test once), against its budget of a
minute on 2 cores.

    python experiments/bench_decode.py runs/an4_cpu_plateau/gru-none-L3-lr0.004-s1-<hash>
    python experiments/bench_decode.py RUN --beams 50,200 --threads 2 --data-root data

Greedy's time is the model's forward pass over the split plus best-path decoding: what scoring a split costs
without the LM. The beam's adds the search, at the run's chosen LM weight and word score from the tuning. Nothing is
cached: every figure is measured in this run, after one forward pass that takes the process's one-time costs
(the CPU GRU kernel's load, oneDNN's JIT), which a run decoding at its end has paid already. Prints a table, then one JSON line per row.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from batchrnn.config import DataConfig, DecodeConfig, TrainConfig  # noqa: E402
from batchrnn.data.corpus import prepare_corpus  # noqa: E402
from batchrnn.data.features import load_features  # noqa: E402
from batchrnn.data.text import greedy_decode  # noqa: E402
from batchrnn.decoding.beam import BeamSearch, language_model  # noqa: E402
from batchrnn.decoding.tuning import emissions, tune  # noqa: E402
from batchrnn.evaluate import checkpoint_path, data_config  # noqa: E402
from batchrnn.metrics import error_rates  # noqa: E402
from batchrnn.training.checkpoint import load_model, typed  # noqa: E402

BUDGET_S = 60.0  # issue 49: the whole tuning of one model at the default beam, on 2 cores


def timed(f):
    start = time.perf_counter()
    out = f()
    return out, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", metavar="RUN_DIR_OR_CHECKPOINT")
    p.add_argument("--beams", default="50,200", help="beam sizes to time on test (default 50,200)")
    p.add_argument("--threads", type=int, default=2, help="torch threads for the forward pass (the search is one)")
    p.add_argument("--data-root", help="folder of the prepared corpus (default: the run's data.root)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = checkpoint_path(args.run)
    model, info = load_model(path)
    data: DataConfig = data_config(info, args.data_root)
    batch_size = typed(TrainConfig, info["config"]["train"]).batch_size
    corpus = prepare_corpus(data)
    sets = {s: load_features(corpus, s, data) for s in ("val", "test")}
    cfg = DecodeConfig()
    lm = language_model(cfg, data, corpus)
    device = torch.device("cpu")

    with torch.no_grad():  # one-time costs out of the timings: the CPU GRU kernel's build or load, oneDNN's JIT
        model(torch.zeros(1, sets["test"].num_features, 200), torch.tensor([200]))

    # the whole tuning at the default beam, as decode_run does it (without its cache)
    cpu = time.process_time()  # the process's CPU seconds (all threads): less moved by other load than the clock
    e, forward_s = timed(lambda: {s: emissions(model, fs, batch_size, device) for s, fs in sets.items()})
    tuned, tuning_s = timed(lambda: tune(BeamSearch(lm, cfg.beam_size), (e["val"], sets["val"].texts),
                                         (e["test"], sets["test"].texts, sets["test"].ids), cfg.lm_weights,
                                         cfg.word_scores, cfg.widen))
    whole, whole_cpu = forward_s + tuning_s, time.process_time() - cpu

    # greedy on test: the forward pass and best-path decoding
    test = sets["test"]
    test_e, test_forward_s = timed(lambda: emissions(model, test, batch_size, device))
    hyps, best_path_s = timed(lambda: [greedy_decode(x[:, None], torch.tensor([x.shape[0]]))[0] for x in test_e])
    greedy_s, n = test_forward_s + best_path_s, len(test)
    rows = [{"decoder": "greedy", "beam": None, "seconds": greedy_s, "s_per_utt": greedy_s / n, "ratio": 1.0,
             "wer": error_rates(test.texts, hyps)[0]}]
    point = (tuned["lm_weight"], tuned["word_score"])
    for beam in (int(b) for b in args.beams.split(",")):
        search = BeamSearch(lm, beam)
        hyps, search_s = timed(lambda: search(test_e, *point))
        total = test_forward_s + search_s
        rows.append({"decoder": "beam", "beam": beam, "seconds": total, "s_per_utt": total / n,
                     "search_s_per_utt": search_s / n, "ratio": total / greedy_s,
                     "wer": error_rates(test.texts, hyps)[0]})

    print(f"{path}: {n} test utterances, {len(sets['val'])} validation; LM {lm.name}, {len(lm.words)} words; "
          f"{args.threads} torch threads")
    print(f"LM weight {point[0]:g}, word score {point[1]:g} (chosen on validation at beam {cfg.beam_size})\n")
    print("| decoder | beam | s | s / utterance | x greedy | test WER % |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['decoder']} | {r['beam'] or '–'} | {r['seconds']:.2f} | {r['s_per_utt']:.4f} | "
              f"{r['ratio']:.1f} | {100 * r['wer']:.1f} |")
    verdict = "within" if whole <= BUDGET_S else "OVER"
    print(f"\nwhole tuning at beam {cfg.beam_size}: {whole:.1f} s ({forward_s:.1f} s emissions of val and test, "
          f"{tuned['seconds']['val_grid']:.1f} s for {len(tuned['grid'])} points on validation, "
          f"{tuned['seconds']['test']:.1f} s test): {verdict} the budget of {BUDGET_S:.0f} s; {whole_cpu:.1f} CPU s")
    for r in rows:
        print(json.dumps(r))
    print(json.dumps({"tuning_s": whole, "tuning_cpu_s": whole_cpu, "emissions_s": forward_s, "val_grid_s": tuned["seconds"]["val_grid"],
                      "test_s": tuned["seconds"]["test"], "points": len(tuned["grid"]), "beam": cfg.beam_size,
                      "budget_s": BUDGET_S, "within_budget": whole <= BUDGET_S}))


if __name__ == "__main__":
    main()

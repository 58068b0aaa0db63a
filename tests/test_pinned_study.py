"""experiments/pinned_study.sh: a study keeps one commit; overrides after -- run that study; `running` names the
study's processes in its folder and `stop` stops them, or does nothing."""
import subprocess
import time

from conftest import ROOT


def git(*args, cwd):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=True).stdout.strip()


def test_a_study_folder_at_another_commit_is_refused(tmp_path):
    main = tmp_path / "main"
    git("clone", "--quiet", "--shared", str(ROOT), str(main), cwd=tmp_path)
    (main / "experiments" / "pinned_study.sh").write_text((ROOT / "experiments" / "pinned_study.sh").read_text())
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "--quiet", "--allow-empty", "-m", "a later commit",
        cwd=main)
    first, later = git("rev-parse", "HEAD~1", cwd=main), git("rev-parse", "HEAD", cwd=main)
    git("worktree", "add", "--quiet", "--detach", str(tmp_path / "study"), first, cwd=main)
    script = ["bash", str(main / "experiments" / "pinned_study.sh")]
    done = subprocess.run([*script, later, str(tmp_path / "study")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and f"is at {first}, not {later}; a study keeps one commit" in done.stderr
    stop = subprocess.run([*script, "stop", str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0 and stop.stdout == ""


def pinned_checkout(tmp_path, data_exit: int = 0):
    """A main clone and its pinned worktree, whose fake .venv/bin/python records its calls in calls.log (and
    exits data_exit from `-m batchrnn.data`). Returns the script's command, the worktree and the start command."""
    main, study = tmp_path / "main", tmp_path / "study"
    git("clone", "--quiet", "--shared", str(ROOT), str(main), cwd=tmp_path)
    (main / "experiments" / "pinned_study.sh").write_text((ROOT / "experiments" / "pinned_study.sh").read_text())
    git("worktree", "add", "--quiet", "--detach", str(study), "HEAD", cwd=main)
    (study / ".venv" / "bin").mkdir(parents=True)
    (study / ".venv" / ".installed-fake").touch()
    python = study / ".venv" / "bin" / "python"
    fail = f'[ "$2" != batchrnn.data ] || {{ echo "no such preset" >&2; exit {data_exit}; }}\n' if data_exit else ""
    python.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path / "calls.log"}\n{fail}')
    python.chmod(0o755)
    script = ["bash", str(main / "experiments" / "pinned_study.sh")]
    start = [*script, git("rev-parse", "HEAD", cwd=main), str(study), "--", "experiment=an4_cpu_plateau",
             "model.rnn=lstm", "hydra/launcher=parallel"]
    return script, study, start


def env(tmp_path) -> dict:
    return {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "AN4_ARCHIVE": str(tmp_path / "an4.tar.gz")}


def test_overrides_after_a_double_dash_run_that_study_instead_of_make_studies(tmp_path):
    """The pinned checkout's data is prepared for each preset named, then `python -m batchrnn.study OVERRIDES
    --wandb` starts there (a fake .venv here records its calls), and commands.log names what ran."""
    script, study, start = pinned_checkout(tmp_path)
    try:
        done = subprocess.run(start, capture_output=True, text=True, timeout=60, env=env(tmp_path))
        assert done.returncode == 0, done.stderr
        calls = tmp_path / "calls.log"
        for _ in range(100):  # the study starts in the background
            if calls.exists() and "batchrnn.study" in calls.read_text():
                break
            time.sleep(0.1)
        assert calls.read_text().splitlines() == [
            "-m batchrnn.data --preset an4_cpu_plateau --root data --features",
            "-m batchrnn.study experiment=an4_cpu_plateau model.rnn=lstm hydra/launcher=parallel --wandb"]
        log = (study / "commands.log").read_text()
        assert log.endswith(": python -m batchrnn.study experiment=an4_cpu_plateau model.rnn=lstm "
                            "hydra/launcher=parallel --wandb\n")
    finally:  # pinned_study.sh started keep_results.sh there
        subprocess.run([*script, "stop", str(study)], capture_output=True, timeout=60, env=env(tmp_path))


def test_a_preset_whose_data_cannot_be_prepared_stops_before_the_study_and_says_where_to_look(tmp_path):
    script, study, start = pinned_checkout(tmp_path, data_exit=2)
    try:
        done = subprocess.run(start, capture_output=True, text=True, timeout=60, env=env(tmp_path))
        assert done.returncode == 1
        assert "preparing the data of an4_cpu_plateau failed, so the study did not start" in done.stderr
        assert f"{study}/study.log" in done.stderr and "no such preset" in (study / "study.log").read_text()
        time.sleep(1)
        assert "batchrnn.study" not in (tmp_path / "calls.log").read_text()
    finally:  # pinned_study.sh started keep_results.sh there
        subprocess.run([*script, "stop", str(study)], capture_output=True, timeout=60, env=env(tmp_path))


def test_a_stray_argument_or_an_empty_double_dash_is_refused(tmp_path):
    script = ["bash", str(ROOT / "experiments" / "pinned_study.sh")]
    stray = subprocess.run([*script, "HEAD", str(tmp_path), "extra"], capture_output=True, text=True, timeout=60)
    assert stray.returncode == 2 and "unexpected 'extra'" in stray.stderr
    empty = subprocess.run([*script, "HEAD", "--"], capture_output=True, text=True, timeout=60)
    assert empty.returncode == 2 and "nothing after --" in empty.stderr
    stop = subprocess.run([*script, "stop", "--", "x"], capture_output=True, text=True, timeout=60)
    assert stop.returncode == 2 and "stop takes no overrides" in stop.stderr


def test_running_names_the_study_processes_in_the_folder_and_stop_stops_them(tmp_path):
    """A stand-in study (sleep, named as the study's command) in one folder and another elsewhere: `running` and
    finish_study.py's check name the first only, and `stop` ends it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("finish_study", ROOT / "experiments" / "finish_study.py")
    finish = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(finish)
    study, elsewhere = tmp_path / "study", tmp_path / "elsewhere"
    study.mkdir()
    elsewhere.mkdir()
    fake = ["bash", "-c", 'exec -a "python -m batchrnn.study" sleep 60']
    procs = [subprocess.Popen(fake, cwd=d) for d in (study, elsewhere)]
    try:
        script = ["bash", str(ROOT / "experiments" / "pinned_study.sh")]
        for _ in range(50):  # until exec has renamed it
            running = subprocess.run([*script, "running", str(study)], capture_output=True, text=True, timeout=60)
            if running.stdout:
                break
            time.sleep(0.1)
        assert running.returncode == 0 and running.stdout.split() == [str(procs[0].pid)]
        assert finish.study_running(study) == [procs[0].pid]
        stop = subprocess.run([*script, "stop", str(study)], capture_output=True, text=True, timeout=60)
        assert f"study: stopped ({procs[0].pid})" in stop.stdout
        assert procs[0].wait(timeout=30) != 0 and procs[1].poll() is None
        assert finish.study_running(study) == []
    finally:
        for proc in procs:
            proc.kill()

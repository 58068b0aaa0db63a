"""experiments/pinned_study.sh: a study keeps one commit; `stop` with nothing running does nothing."""
import subprocess

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

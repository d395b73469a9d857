"""The README's two set-up commands are the ones CI and users run."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    ci_command = (ROOT / ".ci/run").read_text().strip().splitlines()[-1]
    readme = (ROOT / "README.md").read_text()
    commands = [
        line
        for line in readme.split("```bash", 1)[1].split("```", 1)[0].splitlines()
        if line and not line.startswith("#")
    ]
    assert len(commands) == 2
    assert commands[1] == ci_command
    assert "uptrain demo" in commands[0] and "-c constraints.txt" in commands[0]

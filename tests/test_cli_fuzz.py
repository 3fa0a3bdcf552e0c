"""Every mistake on the command line gets help or one line on stderr and exit code 2, never a
traceback: what a new user types first (issue: typer vendoring click printed tracebacks).
Runs the real parser in-process (vx.cli.main), on the typer this install resolved (CI resolves
the newest). pyproject allows typer 0.16 to 0.29: these cases passed on 0.16.1, 0.17.5, 0.18.0,
0.19.0, 0.19.2, 0.22.0, 0.24.2, 0.26.8 and 0.29.2 (click 8.5); 0.15.4 and 0.12.5 fail at import
beside click 8.5 ("Secondary flag is not valid for non-boolean flag")."""

import pytest

COMMANDS = ["extract", "regenerate", "inspect", "verify", "export", "selftest", "bench"]


def run(argv, capsys):
    from vx.cli import main

    code = main(argv)
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err, (argv, out.err[-2000:])
    return code, out


@pytest.mark.parametrize("argv", [["--help"], ["-h"]] + [[c, "--help"] for c in COMMANDS])
def test_help_is_exit_0_and_shows_usage(argv, capsys):
    code, out = run(argv, capsys)
    assert code == 0 and "Usage" in out.out


@pytest.mark.parametrize("argv", [[], ["extract"], ["regenerate"], ["inspect"], ["verify"], ["export"],
                                  ["frobnicate"], ["extract", "d.jsonl", "--bogus"], ["inspect", "out", "--bogus"],
                                  ["verify", "out", "--samples"], ["extract", "d.jsonl", "--dp", "two"],
                                  ["extract", "d.jsonl", "--metrics-port", "port"], ["--bogus"]])
def test_what_the_parser_catches_is_usage_and_exit_2(argv, capsys):
    code, out = run(argv, capsys)
    one_line = len(out.err.strip().splitlines()) == 1 and out.err.startswith("Error: ")  # e.g. a missing value
    assert code == 2 and ("Usage" in out.out + out.err or one_line), (argv, out.err)


@pytest.mark.parametrize("argv, says", [
    (["extract", "examples/chat.jsonl", "--shard-size", "-1"], "--shard-size must be > 0"),
    (["extract", "examples/chat.jsonl", "--store-dtype", "fp7"], "--store-dtype must be one of"),
    (["extract", "examples/chat.jsonl", "--batch-size", "0"], "--batch-size must be >= 1"),
    (["extract", "examples/chat.jsonl", "--metrics-port", "70000"], "--metrics-port must be a TCP port"),
    (["extract", "examples/chat.jsonl", "--progress-every", "-1"], "--progress-every must be >= 0"),
    (["extract", "examples/chat.jsonl", "--backend", "tpu"], "--backend must be one of"),
    (["extract", "examples/chat.jsonl", "--gpus", "a,b"], "--gpus must be comma-separated"),
    (["extract", "/nonexistent/d.jsonl"], "/nonexistent/d.jsonl"),
    (["extract", "examples/chat.jsonl", "-o", "s3://"], "is not an s3://bucket/prefix URL"),
    (["extract", "examples/chat.jsonl", "--upload", "s3:/bucket"], "is not an s3://bucket/prefix URL"),
    (["extract", "examples/chat.jsonl", "--layers", "1,x"], "--layers must be comma-separated integers"),
    (["extract", "examples/chat.jsonl", "--compress", "lz4"], "--compress must be blocks or zstd"),
    (["extract", "examples/chat.jsonl", "--dtype", "fp64"], "--dtype must be one of"),
    (["regenerate", "examples/chat.jsonl", "--metrics-port", "-5"], "--metrics-port must be a TCP port"),
    (["inspect", "s3://bucket/run", "--watch", "--interval", "0"], "--interval and --stall-after must be > 0"),
    (["inspect", "s3://bucket/run"], "with --watch or --plot"),
    (["inspect", "/nonexistent/out"], "/nonexistent/out is not a directory"),
    (["extract", "examples/chat.jsonl", "--regenerate", "--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
    (["extract", "examples/chat.jsonl", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in"),
    (["regenerate", "examples/chat.jsonl", "--gpu-memory-utilization", "0"], "--gpu-memory-utilization must be in"),
    (["regenerate", "examples/chat.jsonl", "--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
    (["regenerate", "examples/chat.jsonl", "--max-model-len", "-4"], "--max-model-len must be >= 1, got -4"),
    (["regenerate", "examples/chat.jsonl", "--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1"),
    (["regenerate", "examples/chat.jsonl", "--temperature", "-1"], "--temperature must be >= 0"),
])
def test_a_bad_value_is_one_line_naming_it_and_exit_2(argv, says, capsys):
    code, out = run(argv, capsys)
    lines = out.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("vx: error: ") and says in lines[0], (argv, out.err)


def test_the_command_list_gives_each_command_a_line_of_its_own(capsys, monkeypatch):
    """`vx --help` on a wide terminal: one summary line per command, not its whole description."""
    monkeypatch.setenv("COLUMNS", "200")
    code, out = run(["--help"], capsys)
    panel = out.out.split("Commands")[1].splitlines()[1:-1]
    rows = [line.strip("│ ").split()[0] for line in panel if line.strip("│ ╰─╯")]
    assert code == 0 and rows == sorted(COMMANDS), out.out


def test_help_states_the_layer_id_rule_whole(capsys, monkeypatch):
    """id k is HF hidden_states[k+1]: the one fact an off-by-one drafter hangs on, printed as written."""
    monkeypatch.setenv("COLUMNS", "300")
    code, out = run(["extract", "--help"], capsys)
    assert code == 0 and "= HF hidden_states[k+1], pre-final-norm" in out.out, out.out


def test_no_help_text_loses_characters_to_rich_markup():
    """typer renders help as Rich markup: a "[word]" in a help text is taken for a style and
    dropped from the screen unless escaped ("\\[")."""
    import typer
    from rich.text import Text

    from vx.cli import app

    for name, cmd in typer.main.get_command(app).commands.items():
        for what, text in [("description", cmd.help), ("summary", cmd.short_help)] + [
                (p.name, getattr(p, "help", None)) for p in cmd.params]:
            text = text or ""
            assert Text.from_markup(text).plain == text.replace("\\[", "["), (name, what, text)

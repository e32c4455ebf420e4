"""The `jaxspec` command: help texts, `generate` and `bench` on a tiny random model saved as a
jaxspec checkpoint, and the errors a user meets with `bench`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxspec import cli
from jaxspec.errors import UserError

SUBCOMMANDS = ("generate", "distill", "train", "bench", "report", "export", "demo",
               "tune-layer-skip", "tune-tree", "table1")


def jaxspec_cmd(*args, timeout=300) -> subprocess.CompletedProcess:
    """The installed console script (its module as a fallback), on CPU."""
    script = Path(sys.executable).parent / "jaxspec"
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "jaxspec.cli"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONIOENCODING="utf-8")
    return subprocess.run([*argv, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=timeout)


# --- help ----------------------------------------------------------------------------------

def test_help_console_script():
    p = jaxspec_cmd("--help", timeout=60)
    assert p.returncode == 0, p.stderr
    for name in SUBCOMMANDS:
        assert name in p.stdout


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_subcommand_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([name, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: jaxspec {name}") and "--config" in out and "key=value" in out


def test_no_subcommand_is_an_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([])
    assert e.value.code != 0


# --- a tiny model --------------------------------------------------------------------------

def tiny_tokenizer():
    """A byte-level BPE without merges (<pad> <bos> <eos>, then the 256 bytes), made with the
    `tokenizers` library and wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                       special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A 2-layer random Llama with the byte tokenizer, saved by `checkpoints.store.save`."""
    from jaxspec.checkpoints import store
    from jaxspec.config import ModelConfig
    from jaxspec.models.params import param_shapes

    config = ModelConfig(arch="llama", vocab_size=264, hidden_size=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, intermediate_size=64, max_position=256,
                         bos_token_id=1, eos_token_ids=(2,), pad_token_id=0)
    rng = np.random.default_rng(0)  # numpy init: no XLA compile for the random draws
    params = {}

    def init(path, shape):
        return (np.ones(shape, np.float32) if path[-1].key.endswith("norm")
                else rng.normal(0, 0.5, shape).astype(np.float32))

    import jax
    params = jax.tree.map_with_path(init, param_shapes(config),
                                    is_leaf=lambda x: isinstance(x, tuple))
    return store.save(tmp_path_factory.mktemp("model") / "tiny", params, config,
                      tokenizer=tiny_tokenizer())


def test_tiny_model_round_trips(tiny_model):
    import jaxspec

    m = jaxspec.load(tiny_model)
    assert m.config.num_layers == 2 and m.tokenizer is not None
    ids = m.tokenizer("ab ä").input_ids
    assert ids[0] == 1 and len(ids) == 1 + 5  # <bos>, then one token a byte
    assert m.tokenizer.decode(ids, skip_special_tokens=True) == "ab ä"


def test_generate_prints_text(tiny_model, capsys):
    cli.main(["generate", "--model", str(tiny_model), "--prompt", "Hallo Welt",
              "--prompt", "Guten Tag", "--max-new-tokens", "8"])
    out, err = capsys.readouterr()
    lines = out.split("\n")
    assert len(lines) == 3 and lines[2] == ""  # one text per prompt
    assert "".join(lines).strip()  # random bytes, but some text
    assert "tokens" in err and "tok/s" in err


def test_generate_with_ngram_drafter_via_config(tiny_model, tmp_path, capsys, monkeypatch):
    """--config YAML < key=value overrides < flags, each shown by a conflicting value."""
    import jaxspec

    calls = []
    real = jaxspec.speculative_generate

    def spy(*args, **kw):
        calls.append(kw)
        return real(*args, **kw)

    monkeypatch.setattr(jaxspec, "speculative_generate", spy)
    (tmp_path / "gen.yaml").write_text(f"model: {tiny_model}\nmax_new_tokens: 4\n"
                                       f"drafter: 'ngram:2'\ngamma: 2\nseed: 7\n")
    cli.main(["generate", "--config", str(tmp_path / "gen.yaml"), "--prompt", "abcabcabc",
              "--max-new-tokens", "5", "max_new_tokens=6", "gamma=3"])
    out, err = capsys.readouterr()
    [kw] = calls  # the YAML's drafter made it speculative
    assert kw["max_new_tokens"] == 5  # the flag beats the override and the YAML
    assert kw["gamma"] == 3  # the override beats the YAML
    assert kw["seed"] == 7  # the YAML beats the default
    assert "tau" in err and out.strip()
    assert 1 <= int(err.split("[")[1].split(" tokens")[0]) <= 5


def test_generate_drafts_the_drafters_own_shape_without_gamma(tiny_model, capsys):
    """Lookahead drafts only its own tree: no --gamma means the drafter's shape, not 4."""
    plain = cli.main(["generate", "--model", str(tiny_model), "--prompt", "abcabc",
                      "--max-new-tokens", "6"]) or capsys.readouterr().out
    cli.main(["generate", "--model", str(tiny_model), "--prompt", "abcabc", "--max-new-tokens",
              "6", "--drafter", "lookahead:2:2:1"])
    out, err = capsys.readouterr()
    assert out == plain and "tau" in err


def test_generate_without_prompt_is_an_error(tiny_model):
    with pytest.raises(SystemExit, match="--prompt"):
        cli.main(["generate", "--model", str(tiny_model)])


# --- bench ---------------------------------------------------------------------------------

QUESTIONS = [
    {"question_id": 1, "category": "translation", "turns": ["Translate: Guten Morgen"]},
    {"question_id": 2, "category": "writing", "turns": ["Write a line about the sea."]},
    {"question_id": "q3", "category": "rag", "turns": ["abc abc abc abc", "and again?"]},
]


@pytest.fixture
def questions(tmp_path) -> Path:
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


def test_bench_writes_answers_and_report(tiny_model, questions, tmp_path, capsys):
    out_dir = tmp_path / "bench"
    cli.main(["bench", "--questions", str(questions), "--target", str(tiny_model),
              "--methods", "ar", "ngram:2", "layerskip:1", "--max-new-tokens", "8",
              "--out-dir", str(out_dir), "--dtype", "bfloat16"])
    printed = capsys.readouterr().out
    run_dir = out_dir / f"{tiny_model.name}-bfloat16"
    answers = {p.stem: p for p in run_dir.glob("*.jsonl")}
    assert set(answers) == {"ar-t0", "ngram-2-g4-t0", "layerskip-1-g4-t0"}
    from jaxspec.questions import read_answers

    for name, path in answers.items():
        records = read_answers(path)
        assert [r["question_id"] for r in records] == [1, 2, "q3"]
        for r in records:
            choice = r["choices"][0]
            assert len(choice["turns"]) == len(choice["new_tokens"]) == \
                len([q for q in QUESTIONS if q["question_id"] == r["question_id"]][0]["turns"])
            assert all(0 <= n <= 8 for n in choice["new_tokens"])
        if name == "ar-t0":
            assert all(a == 1 for r in records for a in r["choices"][0]["accept_lengths"])
    stamps = [(r["question_id"], r["tstamp"]) for p in answers.values() for r in read_answers(p)]
    # the methods take turns on each question: a burst of noise falls on all of them
    assert max(t for q, t in stamps if q == 1) < min(t for q, t in stamps if q == 2)
    report = (run_dir / "report.md").read_text()
    assert report.strip() and report.strip() in printed
    for name in ("ngram", "layerskip"):
        assert name in report
    results = json.loads((out_dir / "results.json").read_text())
    assert f"{tiny_model} (bfloat16)" in results


def test_bench_int8_row_and_llama_cpp_skipped_without_its_extra(tiny_model, questions, tmp_path,
                                                               capsys, monkeypatch):
    """`ar:int8` answers on the target loaded in int8; without llama-cpp-python the llama.cpp
    rows are skipped with the install command, not failed, and the other rows still run."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    out_dir = tmp_path / "bench"
    cli.main(["bench", "--questions", str(questions), "--target", str(tiny_model),
              "--methods", "ar", "ar:int8", "llama.cpp", "llama.cpp-lookup",
              "--max-new-tokens", "6", "--out-dir", str(out_dir), "--dtype", "bfloat16"])
    err = capsys.readouterr().err
    assert "skipping the llama.cpp rows" in err and "bash install.sh --llamacpp" in err
    run_dir = out_dir / f"{tiny_model.name}-bfloat16"
    assert {p.stem for p in run_dir.glob("*.jsonl")} == {"ar-t0", "ar-int8-t0"}
    assert "ar-int8" in (run_dir / "report.md").read_text()


def test_bench_refuses_two_methods_with_one_name(tmp_path):
    from jaxspec.bench import specbench

    for run in ("a", "b"):
        (tmp_path / run / "drafter").mkdir(parents=True)
    with pytest.raises(UserError, match="drafter-drafter-g1-t0 appear twice"):
        specbench.parse_methods([f"drafter:{tmp_path}/a/drafter", f"drafter:{tmp_path}/b/drafter"],
                                [1], [0.0])
    assert len(specbench.parse_methods(["ngram:2", "ngram:3"], [1], [0.0])) == 2


def test_tune_layer_skip_writes_a_bench_config_that_runs(tiny_model, questions, tmp_path,
                                                         capsys, monkeypatch):
    import yaml

    from jaxspec.decoding import profile

    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(profile, "bandwidth_gbs", lambda: 10.0)  # not what this test checks
    out = tmp_path / "skip.yaml"
    cli.main(["tune-layer-skip", "--model", str(tiny_model), "--questions", str(questions),
              "--limit", "2", "--max-new-tokens", "8", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "skip  1 " in printed and "measured: " in printed and f"wrote {out}" in printed
    cfg = yaml.safe_load(out.read_text())
    assert cfg["target"] == str(tiny_model) and cfg["limit"] == 2
    assert cfg["methods"][0] == "ar" and cfg["methods"][1] in ("layerskip:0", "layerskip:1")
    cli.main(["bench", "--config", str(out), "--out-dir", str(tmp_path / "bench")])
    assert "layerskip" in capsys.readouterr().out


def test_tune_tree_writes_a_bench_config_that_runs(tiny_model, questions, tmp_path, capsys,
                                                   monkeypatch):
    import yaml

    from jaxspec.decoding import profile

    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(profile, "bandwidth_gbs", lambda: 10.0)  # not what this test checks
    out = tmp_path / "tree.yaml"
    cli.main(["tune-tree", "--model", str(tiny_model), "--drafter", "layerskip:1", "--questions",
              str(questions), "--limit", "2", "--max-new-tokens", "8", "--width", "2",
              "--depth", "2", "--budget", "4", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "depth  steps  rank 0  rank 1" in printed and "chosen tree: " in printed
    assert f"wrote {out}" in printed
    cfg = yaml.safe_load(out.read_text())
    assert cfg["target"] == str(tiny_model) and cfg["limit"] == 2
    assert cfg["methods"] == ["ar", "layerskip:1"] and 1 <= cfg["gammas"][0] <= 2
    tree = cli._tree(cfg["tree"])
    assert 1 <= len(tree) <= 4 and max(map(len, tree)) <= 2
    cli.main(["bench", "--config", str(out), "--out-dir", str(tmp_path / "bench")])
    assert "-tree" in capsys.readouterr().out


def test_tune_tree_checks_its_settings_first(tiny_model):
    with pytest.raises(SystemExit, match="width must be an int >= 1, got 0"):
        cli.main(["tune-tree", "--model", str(tiny_model), "--drafter", "ngram",
                  "--prompt", "ab", "--width", "0"])
    with pytest.raises(SystemExit, match="is not a hidden-state drafter checkpoint"):
        cli.main(["tune-tree", "--model", str(tiny_model), "--drafter", "ngram",
                  "--prompt", "ab", "--into", str(tiny_model)])


# Each bad input, run once as a subprocess (the exit status and stderr a user sees); the tests
# below read the same results.
BAD_INPUTS = {
    "malformed line": ("line 2 loses its closing brace", ["ar"]),
    "missing field": ("a 4th line without category and turns", ["ar"]),
    "unknown method": (None, ["ar", "medusa:3"]),
    "missing drafter": (None, ["ar", "drafter:{tmp}/no_such_drafter"]),
}


@pytest.fixture(scope="module")
def bench_failures(tiny_model, tmp_path_factory):
    """{case: (question file, CompletedProcess)}, each case run on first use."""
    results = {}

    def get(case):
        if case not in results:
            tmp = tmp_path_factory.mktemp("bad_input")
            lines = [json.dumps(q) for q in QUESTIONS]
            if case == "malformed line":
                lines[1] = lines[1][:-1]
            elif case == "missing field":
                lines.append(json.dumps({"question_id": 9}))
            questions = tmp / "question.jsonl"
            questions.write_text("\n".join(lines) + "\n")
            methods = [m.format(tmp=tmp) for m in BAD_INPUTS[case][1]]
            p = jaxspec_cmd("bench", "--questions", questions, "--target", tiny_model,
                            "--methods", *methods, "--max-new-tokens", "4", "--out-dir",
                            tmp / "out")
            assert p.returncode != 0, f"{case}: jaxspec bench exited 0"
            results[case] = questions, p
        return results[case]
    return get


def test_bench_malformed_question_line_names_the_line(bench_failures):
    questions, p = bench_failures("malformed line")
    assert f"{questions}:2:" in p.stderr and "invalid JSON" in p.stderr


def test_bench_question_missing_field_names_the_line(bench_failures):
    questions, p = bench_failures("missing field")
    assert f"{questions}:4:" in p.stderr and "category" in p.stderr


def test_bench_unknown_method(bench_failures):
    _, p = bench_failures("unknown method")
    assert "unknown method 'medusa:3'" in p.stderr and "ngram" in p.stderr


def test_bench_missing_drafter_path(bench_failures):
    questions, p = bench_failures("missing drafter")
    missing = questions.parent / "no_such_drafter"
    assert str(missing) in p.stderr and "does not exist" in p.stderr


def test_bench_without_questions_or_target(tiny_model, questions):
    with pytest.raises(SystemExit, match="--questions"):
        cli.main(["bench", "--target", str(tiny_model), "--methods", "ar"])
    with pytest.raises(SystemExit, match="target and methods"):
        cli.main(["bench", "--questions", str(questions), "--methods", "ar"])


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bench_user_errors_need_no_traceback(bench_failures, case):
    """A malformed file, a mistyped method or path is the user's error, not jaxspec's: one
    line naming the subcommand and the problem, no traceback."""
    _, p = bench_failures(case)
    assert "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith("jaxspec bench: ") and len(p.stderr.strip().splitlines()) == 1

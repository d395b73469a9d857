"""The resume rule every resumable folder shares (train, compare, tokenize): which keys count,
how a key an older uptrain did not record counts, and the one wording of a refusal."""

from __future__ import annotations

from dataclasses import dataclass

from uptrain.checkpoint.resumable import PACKAGE, Change, ResumeRule, settings_changed, settled, unreadable_record
from uptrain.data.corpus import split_path
from uptrain.options import Schema, option


def test_every_key_but_the_operational_ones_identifies_the_work():
    rule = ResumeRule(frozenset({"report_to", "conversion.calibration_device"}))
    recorded = {"lr": 0.1, "report_to": ["jsonl"], "conversion": {"grouping": "contiguous", "calibration_device": "x"}}
    assert rule.changes(recorded, recorded) == []
    current = {"lr": 0.2, "report_to": ["none"], "conversion": {"grouping": "similarity", "calibration_device": "y"}}
    assert rule.changes(recorded, current) == [
        Change("lr", 0.1, 0.2),
        Change("conversion.grouping", "contiguous", "similarity"),
    ]


def test_a_key_an_earlier_uptrain_did_not_record_held_its_default():
    rule = ResumeRule(defaults={"seed": 0, "conversion": {"grouping": "contiguous"}})
    assert rule.changes({"lr": 0.1}, {"lr": 0.1, "seed": 0, "conversion": {"grouping": "contiguous"}}) == []
    assert rule.changes({"lr": 0.1}, {"lr": 0.1, "seed": 1}) == [Change("seed", 0, 1)]
    assert rule.changes({"lr": 0.1}, {"lr": 0.1, "new_key": 3}) == [Change("new_key", None, 3)]  # no default: None


@dataclass(kw_only=True)
class _Record(Schema):
    source: str = option(help="required: every record holds it")
    seed: int = option(0, help="added by a later uptrain")
    report_to: str = option("jsonl", help="bookkeeping")


def test_a_schema_s_rule_takes_its_defaults_for_keys_a_record_lacks():
    rule = ResumeRule.for_schema(_Record, ["report_to"])
    assert rule == ResumeRule(frozenset({"report_to"}), {"seed": 0, "report_to": "jsonl"})
    current = _Record(source="a", seed=1, report_to="none").to_dict()
    assert rule.changes({"source": "a"}, current) == [Change("seed", 0, 1)]


def test_lists_and_tuples_count_alike():
    assert ResumeRule().changes({"pooling": ["mean", "first"]}, {"pooling": ("mean", "first")}) == []


def test_a_shipped_file_counts_by_its_place_in_the_package():
    shipped = split_path("train")  # the corpus `uptrain compare` defaults to
    place = shipped.relative_to(PACKAGE).as_posix()
    assert settled(str(shipped)) == f"<uptrain>/{place}"
    assert settled(f"/somewhere/else/uptrain/{place}") == f"<uptrain>/{place}"  # the checkout moved
    assert settled([f"/a/uptrain/{place}", "rel/x.txt"]) == [f"<uptrain>/{place}", "rel/x.txt"]
    # Not files of the package: paths as they are.
    for path in (f"/somewhere/else/notuptrain/{place}", "/data/uptrain/no-such-file.jsonl", f"uptrain/{place}"):
        assert settled(path) == path


def test_shipped_assets_count_by_their_place_now_wherever_they_were_recorded():
    """Asset folders (the reference models) count like shipped files, and a path recorded before
    the assets moved (uptrain/data/ → uptrain/assets/) names the asset where it is now."""
    assert settled(str(PACKAGE / "assets" / "reference")) == "<uptrain>/assets/reference"
    for old, now in (
        ("data/reference", "assets/reference"),
        ("data/reference_t5/", "assets/reference_t5"),
        ("data/corpus/validation.jsonl.gz", "assets/corpus/validation.jsonl.gz"),
        ("data/tokenizer/tokenizer.json", "assets/tokenizer/tokenizer.json"),
    ):
        assert settled(f"{PACKAGE}/{old}") == settled(f"/a/moved/checkout/uptrain/{old}") == f"<uptrain>/{now}"
    # What is in the package's data/ now (modules) stays there; no asset of that name: a path as it is.
    assert settled("/a/uptrain/data/corpus.py") == "<uptrain>/data/corpus.py"
    # Folders of the package that are not assets, and assets that never were, are paths as they are.
    for path in ("/a/uptrain/data/reference_x", "/a/uptrain/train", "/a/uptrain/data", "/a/uptrain/assets/nothing"):
        assert settled(path) == path


def test_one_wording_for_every_refusal():
    one = settings_changed("the run in /r", [Change("lr", 0.003, 1.0)], "output_dir")
    assert str(one) == (
        "cannot resume the run in /r: its settings changed (lr: 0.003 → 1.0); rerun with the earlier value "
        "to continue it, or pass --overwrite to start over (or use another output_dir)"
    )
    digest_a, digest_b = "ab" * 32, "cd" * 32
    changes = [Change("seq_len", 16, 8), Change("tokenizer", digest_a, digest_b)]
    two = settings_changed("the tokenize to /t", changes, "OUT")
    assert "(seq_len: 16 → 8; tokenizer: 'abababababab…' → 'cdcdcdcdcdcd…'); rerun with the earlier values" in str(two)
    assert "\n" not in str(two) and str(two).endswith("(or use another OUT)")
    damaged = unreadable_record("/r/run.json is damaged (not a JSON object)", "output_dir")
    assert str(damaged) == (
        "cannot resume: /r/run.json is damaged (not a JSON object); use another output_dir or --overwrite"
    )

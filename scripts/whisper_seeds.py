"""The Whisper study's uptrained rows pooled over seeds: several output folders of
`scripts/whisper_study.py`, the same rows run with different --seed (clip order), scored on the
same held-out clips.

    python scripts/whisper_seeds.py whisper-study-seed0 whisper-study-seed1 whisper-study-seed2

Per row uptrained in every folder: its final WER in each, and its errors summed over the folders
over the MHA row's (each folder's MHA trained with that seed), with a 95 % interval from a paired
bootstrap over the (seed, clip) pairs (`whisper_study.wer_ratio`): one seed's clip order is one
draw of the uptraining, and the pooled ratio averages it out where one folder cannot. A Markdown
table on stdout; one line of JSON after it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from uptrain import UptrainError


def pooled(folders: list[Path]) -> list[dict]:
    """Per row with a final score in every folder (MHA's first): each folder's WER and the pooled ratio."""
    import whisper_study as study  # beside this script: the first entry of sys.path when it runs

    finals = [{p.stem: p for p in (f / "scores" / "final").glob("*.json")} for f in folders]
    if not all("mha" in kept for kept in finals):
        missing = [str(f) for f, kept in zip(folders, finals) if "mha" not in kept]
        raise UptrainError(f"no uptrained MHA row in {', '.join(missing)}: run the study's mha row there first")
    names = sorted(set.intersection(*(set(kept) for kept in finals)), key=lambda n: (n != "mha", n))
    mha = [study.clip_errors(kept["mha"]) for kept in finals]
    mha_flat = [pair for errors in mha for pair in errors]
    rows = []
    for name in names:
        per_seed = [study.clip_errors(kept[name]) for kept in finals]
        if len({len(errors) for errors in per_seed + mha}) != 1:
            raise UptrainError(f"{name}: the folders were scored on different numbers of clips")
        wers = [100 * sum(e for e, _ in errors) / sum(w for _, w in errors) for errors in per_seed]
        flat = [pair for errors in per_seed for pair in errors]
        ratio = None if name == "mha" else study.wer_ratio(flat, mha_flat)
        rows.append({"name": name, "wer_per_seed": wers, "vs_mha": ratio})
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="whisper_study.py output folders, one per seed")
    args = parser.parse_args(argv)
    from uptrain.evaluation.scores import require

    require("jiwer", "jiwer", "whisper_seeds.py's per-clip word errors")
    rows = pooled(args.folders)
    print("| row | " + " | ".join(f"WER end ({f.name})" for f in args.folders) + " | pooled WER / MHA's (95 % CI) |")
    print("|---|" + "---|" * (len(args.folders) + 1))
    for r in rows:
        ratio = r["vs_mha"]
        pooled_column = "—" if ratio is None else f"{ratio['ratio']:.3f} ({ratio['low']:.3f}–{ratio['high']:.3f})"
        print(f"| {r['name']} | " + " | ".join(f"{w:.1f}" for w in r["wer_per_seed"]) + f" | {pooled_column} |")
    print(json.dumps({"folders": [str(f) for f in args.folders], "rows": rows}))


if __name__ == "__main__":
    try:
        main()
    except UptrainError as err:
        sys.exit(f"error: {err}")

"""How a speech run is counted: clips, seconds of audio and decoder tokens.

A text run counts `seq_len` tokens per block, and its budgets, plan, tokens/s and model card say
tokens and blocks. Whisper's encoder reads every clip as one window of fixed length (its feature
extractor's `chunk_length`: 30 s, `max_source_positions` = 1500 encoder positions) whatever the
audio's length, and `seq_len` is no length of it: there the plan, the speed and the card say
clips, audio seconds and decoder (label) tokens instead. Token budgets (`max_tokens`) still count
`seq_len` per clip, as every run's do (`TrainConfig.tokens_per_step`).
"""

from __future__ import annotations

from dataclasses import dataclass

from uptrain.architecture import Architecture


@dataclass(frozen=True)
class SpeechUnits:
    """What a speech run's steps hold, in the units of its data."""

    clips_per_step: int  # the global batch
    window_s: float  # the audio each clip is read as (padded or cut to it)
    encoder_positions: int | None  # the encoder's positions per clip (Whisper: 1500)
    train_clips: int
    train_audio_s: float  # seconds of audio in train_data, each clip's own length
    train_decoder_tokens: int  # label tokens in train_data (the prompt, the transcripts, EOS)

    @property
    def window(self) -> str:
        """Each clip as the encoder reads it, for messages."""
        positions = f", {self.encoder_positions:,} encoder positions" if self.encoder_positions else ""
        return f"a {self.window_s:g} s window{positions}"

    def audio_s(self, clips: int) -> float:
        """Seconds of audio in `clips` clips drawn from train_data (its mean clip length each)."""
        return clips * self.train_audio_s / self.train_clips

    def plan_lines(self, total_steps: int, steps_left: int, config, processes: int) -> list[str]:
        """The plan's lines of what the run holds, in clips (where a text run's say tokens)."""
        total, left = total_steps * self.clips_per_step, steps_left * self.clips_per_step
        return [
            f"  clips            {total:,} ({left:,} to go), about {self.audio_s(total):,.0f} s of audio",
            f"  clips per step   {self.clips_per_step} = batch_size {config.batch_size} × grad_accum "
            f"{config.grad_accum} × processes {processes}; each read as {self.window}",
        ]

    def train_data(self, epochs: float) -> str:
        """The plan's train data, in clips, audio seconds and decoder tokens."""
        return (
            f"{self.train_clips} clips ({self.train_audio_s:,.1f} s of audio, {self.train_decoder_tokens:,} "
            f"decoder tokens), {epochs:.3g} epochs over them"
        )

    def record(self, steps: int) -> dict:
        """The uptraining record's `speech` entry (`uptrain.json`), which the model card reads."""
        clips = steps * self.clips_per_step
        return {
            "clips": clips,
            "clips_per_step": self.clips_per_step,
            "audio_seconds": round(self.audio_s(clips), 3),
            "window_seconds": self.window_s,
            "encoder_positions": self.encoder_positions,
        }


def speech_units(examples, clips_per_step: int, model_config: dict, arch: Architecture | None) -> SpeechUnits:
    """The units of a speech run over `examples` (`PairExamples` of audio)."""
    extractor = examples.feature_extractor
    key = arch.source_positions_key if arch is not None else None
    positions = model_config.get(key) if key else None
    return SpeechUnits(
        clips_per_step=clips_per_step,
        window_s=float(getattr(extractor, "chunk_length", 0) or 0),
        encoder_positions=positions if isinstance(positions, int) else None,
        train_clips=len(examples),
        train_audio_s=float(sum(examples.seconds)),
        train_decoder_tokens=sum(map(len, examples.targets)),
    )


def card_budget(speech: dict, steps: int, processes: str) -> str:
    """The model card's budget line of a speech run (`SpeechUnits.record`)."""
    positions = speech.get("encoder_positions")
    window = f"a {speech['window_seconds']:g} s window" + (f" of {positions:,} encoder positions" if positions else "")
    return (
        f"{speech['clips']:,} clips (about {speech['audio_seconds']:,.0f} s of audio) in {steps:,} optimizer steps "
        f"(global batch {speech['clips_per_step']} clips, each read as {window}; {processes})"
    )

"""The run summary's bytes line says "less" or "more" as the bytes compare with fp32 DDP's."""

from __future__ import annotations

import pytest

from lightning_optim.report import format_table

BASE = {"output_dir": "out", "num_params": 10, "steps": 4, "initial_val_loss": 5.0, "final_val_loss": 4.0,
        "final_train_loss": 4.1, "train_tokens_per_sec": 100.0, "wall_time_s": 1.0}


@pytest.mark.parametrize("sent,fp32,words", [(1e6, 32e6, "32.0x less"), (10e6, 8e6, "1.2x more"),
                                             (4e6, 4e6, "1.0x less")])
def test_the_bytes_line_compares_with_fp32_ddp(sent, fp32, words):
    comm = {"bytes_sent": sent, "fp32_bytes": fp32, "compression_ratio": fp32 / sent, "steps": 4,
            "steps_without_ddp_allreduce": 4}
    text = format_table({**BASE, "comm": comm})
    assert words in text and f"{sent / 1e6:,.1f} MB vs {fp32 / 1e6:,.1f} MB" in text


def test_no_bytes_line_without_communication():
    assert "bytes sent" not in format_table(BASE)

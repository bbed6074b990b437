"""Tier a: only the finished run's DeepSpeed shm segments are removed (matched by master port and rank)."""

from __future__ import annotations

from ds_terapipe.runtime.execution import shm


def test_removes_only_that_port_and_rank(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    names = ["deepspeed_allreduce_buffer_0_127.0.0.1_29500_0", "deepspeed_allreduce_buffer_0_127.0.0.1_29500_1",
             "deepspeed_allreduce_buffer_0_127.0.0.1_129500_0", "deepspeed_allreduce_buffer_0_127.0.0.1_2950_0",
             "unrelated_29500_0"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert [p.rsplit("/", 1)[1] for p in shm.remove_shm_segments(29500, local_rank=1)] == [names[1]]
    assert sorted(p.rsplit("/", 1)[1] for p in shm.remove_shm_segments("29500")) == [names[0]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])

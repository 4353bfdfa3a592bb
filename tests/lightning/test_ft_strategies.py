"""The fault-tolerant strategies ``ft_diloco`` and ``ft_ddp``: every replica group its own launch of a Lightning fit
(``ft_workers.py``; the main job for the Hydra route), a torchft Lighthouse in this process.

Two replicas, failure-free: ``ft_diloco`` equals DiLoCo on two workers written from the paper
(``tests/reference/diloco.py``) fed the same batches, after every step and after the final synchronisation;
``ft_ddp`` equals training on the averaged gradients of the two replicas' batches, computed here; both replicas hold
one model. A checkpoint after step 7 (between synchronisations) resumed by new processes ends bitwise where the
straight fit ends. A replica SIGKILLed mid-fit: the survivor goes on committing synchronisations alone and finishes
its fit. ``python -m lightning_optim.train strategy=ft_diloco`` on two replicas, the first hosting the Lighthouse
(``strategy.lighthouse=local:PORT``), runs to the end. Bad arguments are refused naming the argument.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

import lightning_optim
from lightning_optim.fault_tolerance import local_lighthouse
from tests.distributed import free_port
from tests.lightning.ft_workers import HALF, STEPS, SYNC_EVERY, batch_at, batches, flat, inner, loss_of, network
from tests.reference.diloco import RefDiLoCo

WORKER = Path(__file__).with_name("ft_workers.py")
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RUST_LOG": "warn", "PYTHONWARNINGS": "ignore"}
BOUND = 180.0  # seconds any launch may take on a busy machine
REPLICAS = ("r0", "r1")
STRATEGIES = ("ft_diloco", "ft_ddp")


class Launches:
    """Replica processes (``ft_workers.py`` or the main job), each a launch of its own; every wait bounded."""

    def __init__(self, workdir: Path) -> None:
        self.workdir, self.procs = Path(workdir), {}

    def start(self, name: str, argv: list[str]) -> None:
        out = self.workdir / name
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "log.txt", "w") as log:
            self.procs[name] = subprocess.Popen(argv, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True)

    def worker(self, name: str, replica: str, fits: dict[str, str], **options) -> None:
        """``ft_workers.py`` as replica ``replica``: one fit per ``{strategy: Lighthouse address}``, in order."""
        argv = [sys.executable, str(WORKER), "--replica", replica, "--out", str(self.workdir / name)]
        for strategy, lighthouse in fits.items():
            argv += ["--fit", f"{strategy}={lighthouse}"]
        for key, value in options.items():
            argv += [f"--{key.replace('_', '-')}"] if value is True else [f"--{key.replace('_', '-')}", str(value)]
        self.start(name, argv)

    def log(self, name: str) -> str:
        return (self.workdir / name / "log.txt").read_text()[-4000:]

    def events(self, name: str, fit: str = "ft_diloco") -> list[dict]:
        path = self.workdir / name / fit / "events.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines if line.endswith("}")]

    def exit_code(self, name: str) -> int:
        try:
            return self.procs[name].wait(BOUND)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still running after {BOUND:.0f}s:\n{self.log(name)}") from None

    def finished(self, name: str, fits: tuple[str, ...] = ()) -> dict:
        """The launch's result of each fit in ``fits``, once it exited 0."""
        code = self.exit_code(name)
        assert code == 0, f"{name} exited {code}:\n{self.log(name)}"
        return {fit: torch.load(self.workdir / name / fit / "result.pt", weights_only=False) for fit in fits}

    def wait_for(self, name: str, condition, what: str) -> dict:
        deadline = time.monotonic() + BOUND
        while time.monotonic() < deadline:
            for event in self.events(name):
                if condition(event):
                    return event
            if self.procs[name].poll() is not None:
                raise AssertionError(f"{name} exited ({self.procs[name].returncode}) before {what}:\n{self.log(name)}")
            time.sleep(0.05)
        raise AssertionError(f"{name}: no event {what} within {BOUND:.0f}s:\n{self.log(name)}")

    def kill(self, name: str) -> None:
        os.killpg(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait(10)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per strategy and replica: the straight fit of STEPS steps (a checkpoint after step HALF), and that checkpoint
    resumed to STEPS by new processes. Each replica process fits with ft_diloco, then with ft_ddp, each strategy
    against its own Lighthouse (quorums of both replicas)."""
    tmp = tmp_path_factory.mktemp("ft_strategies")
    lighthouses = {s: local_lighthouse(min_replicas=2, heartbeat_timeout_ms=2000) for s in STRATEGIES}
    fits = {s: lighthouse.address() for s, lighthouse in lighthouses.items()}
    launches = Launches(tmp)
    out: dict = {"full": {}, "resumed": {}}
    try:
        for phase in ("full", "resumed"):
            for r in REPLICAS:
                options = {"checkpoint": True} if phase == "full" else {"resume_from": tmp / f"{r}-full"}
                launches.worker(f"{r}-{phase}", r, fits, **options)
            done = {r: launches.finished(f"{r}-{phase}", STRATEGIES) for r in REPLICAS}
            out[phase] = {s: {r: done[r][s] for r in REPLICAS} for s in STRATEGIES}
    finally:
        launches.close()
        for lighthouse in lighthouses.values():
            lighthouse.shutdown()
    return out


def _names() -> list[str]:
    return [name for name, _ in network().named_parameters()]


def _reference_diloco() -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """DiLoCo on two workers from the paper's equations: each worker's flat params after every step, and after the
    final synchronisation."""
    net, names = network(), _names()
    ref = RefDiLoCo([p.detach() for p in net.parameters()], 2, inner, sync_every=SYNC_EVERY, outer_lr=0.7,
                    outer_momentum=0.9, nesterov=True)

    def grad_fn(w, t, params):
        x, y = batch_at(w, t)
        prediction = torch.func.functional_call(net, dict(zip(names, params)), (x,))
        torch.nn.functional.mse_loss(prediction, y).backward()

    steps = []
    for _ in range(STEPS):
        ref.step(grad_fn)
        steps.append([torch.cat([p.detach().reshape(-1) for p in params]) for params in ref.workers])
    ref.finish()
    return steps, [torch.cat([p.detach().reshape(-1) for p in params]) for params in ref.workers]


def _reference_ddp() -> list[torch.Tensor]:
    """One model stepped on the mean of the two replicas' gradients: its flat params after every step."""
    net = network()
    opt = inner(net.parameters())
    steps = []
    for t in range(STEPS):
        grads = []
        for w in range(2):
            net.zero_grad()
            loss_of(net, *batch_at(w, t + 1)).backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        for p, g0, g1 in zip(net.parameters(), *grads):
            p.grad = (g0 + g1) / 2
        opt.step()
        steps.append(flat(net))
    return steps


def test_ft_diloco_equals_diloco_on_two_workers(runs):
    full = runs["full"]["ft_diloco"]
    steps, finished = _reference_diloco()
    for w, r in enumerate(REPLICAS):
        assert len(full[r]["steps"]) == STEPS and full[r]["global_step"] == STEPS
        for t, params in enumerate(full[r]["steps"]):  # fp32 rounding orders differ in the outer step: ulps
            torch.testing.assert_close(params, steps[t][w], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, r=r, t=t: f"{r}, step {t + 1}: {m}")
        torch.testing.assert_close(full[r]["params"], finished[w], rtol=1e-5, atol=1e-6)
        summary = full[r]["summary"]  # joined, three synchronisations, the final one: all committed by both
        assert (summary["replicas"], summary["committed_step"], summary["rounds_discarded"]) == (2, 5, 0), summary
        assert summary["bytes_sent"] > 0 and summary["sync_every"] == SYNC_EVERY
    assert torch.equal(full["r0"]["params"], full["r1"]["params"])  # one model on both replicas
    assert not torch.equal(full["r0"]["steps"][HALF - 1], full["r1"]["steps"][HALF - 1])  # apart between syncs


def test_ft_ddp_equals_training_on_the_averaged_gradients(runs):
    full = runs["full"]["ft_ddp"]
    reference = _reference_ddp()
    for r in REPLICAS:
        assert len(full[r]["steps"]) == STEPS
        for t, params in enumerate(full[r]["steps"]):
            torch.testing.assert_close(params, reference[t], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, r=r, t=t: f"{r}, step {t + 1}: {m}")
        summary = full[r]["summary"]
        assert (summary["replicas"], summary["steps_committed"], summary["steps_discarded"]) == (2, STEPS, 0), summary
    for t in range(STEPS):  # the same averaged gradient on both: one model after every step
        assert torch.equal(full["r0"]["steps"][t], full["r1"]["steps"][t]), t
    one = network()
    opt = inner(one.parameters())
    for t in range(1, STEPS + 1):  # replica r0's batches alone train another model
        opt.zero_grad()
        loss_of(one, *batch_at(0, t)).backward()
        opt.step()
    assert not torch.allclose(flat(one), full["r0"]["params"], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_checkpoint_between_synchronisations_resumes_bitwise_in_new_processes(runs, strategy):
    for r in REPLICAS:
        full, resumed = runs["full"][strategy][r], runs["resumed"][strategy][r]
        assert resumed["global_step"] == STEPS and len(resumed["steps"]) == STEPS - HALF
        for t, params in enumerate(resumed["steps"], start=HALF):
            assert torch.equal(params, full["steps"][t]), f"{strategy} {r}: step {t + 1} differs after the resume"
        assert torch.equal(resumed["params"], full["params"])
        assert resumed["summary"]["committed_step"] == full["summary"]["committed_step"]


def test_a_replica_killed_mid_fit_leaves_the_survivor_training(tmp_path):
    lighthouse = local_lighthouse(min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=2000)
    launches = Launches(tmp_path)
    steps = 60
    (tmp_path / "start").mkdir()
    try:
        for r in REPLICAS:
            launches.worker(r, r, {"ft_diloco": lighthouse.address()}, steps=steps, step_sleep=0.1, start_with=2,
                            start_dir=tmp_path / "start")
        both = launches.wait_for("r1", lambda e: e["replicas"] == 2 and e["step"] >= 2 * SYNC_EVERY,
                                 "of a step after a synchronisation of both replicas")
        launches.kill("r1")
        killed_at = time.time()
        survivor = launches.finished("r0", ("ft_diloco",))["ft_diloco"]
    finally:
        launches.close()
        lighthouse.shutdown()
    assert survivor["global_step"] == steps and len(survivor["steps"]) == steps  # it never stopped
    after = [e for e in launches.events("r0") if e["time"] > killed_at]
    alone = [e for e in after if e["replicas"] == 1]
    assert alone and alone[-1]["committed"] > both["committed"] + 1, after[-3:]  # synchronisations committed alone
    assert [e["step"] for e in launches.events("r0")] == list(range(1, steps + 1))
    assert all(math.isfinite(v) for v in survivor["params"].tolist())
    assert survivor["summary"]["replicas"] == 1


def test_the_main_job_runs_two_replicas_one_hosting_the_lighthouse(tmp_path):
    port = free_port()
    launches = Launches(tmp_path)
    common = ["trainer=smoke", "trainer.max_steps=8", "trainer.val_check_interval=8", "data.max_bytes=100000",
              "model.n_layer=1", "model.d_model=64", "strategy=ft_diloco", "strategy.sync_every=4",
              "strategy.min_replica_size=2", "strategy.host=localhost", "strategy.timeout=20"]
    for index, (r, lighthouse) in enumerate((("r0", f"local:{port}"), ("r1", f"http://localhost:{port}"))):
        launches.start(r, [sys.executable, "-m", "lightning_optim.train", *common, f"strategy.replica_id={r}",
                           f"strategy.lighthouse={lighthouse}", f"data.seed={index + 1}",
                           f"hydra.run.dir={tmp_path / r / 'run'}"])
    try:
        for r in REPLICAS:
            launches.finished(r)
    finally:
        launches.close()
    assert "a torchft Lighthouse runs in this replica" in launches.log("r0")
    for r in REPLICAS:
        summary = json.loads((tmp_path / r / "run" / "summary.json").read_text())
        comm = summary["comm"]
        assert summary["steps"] == 8 and summary["world_size"] == 1, summary
        assert (comm["replica_id"], comm["replicas"], comm["committed_step"], comm["rounds_discarded"]) == (r, 2, 3, 0)
        assert summary["final_val_loss"] < summary["initial_val_loss"]


# ------------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("cls,arg,value", [
    ("FTDiLoCoStrategy", "sync_every", 0),
    ("FTDiLoCoStrategy", "compressor", "zip"),
    ("FTDiLoCoStrategy", "min_replica_size", 0),
    ("FTDiLoCoStrategy", "lighthouse", "ftp://host:1"),
    ("FTDiLoCoStrategy", "lighthouse", "local:0"),
    ("FTDiLoCoStrategy", "replica_id", ""),
    ("FTDiLoCoStrategy", "timeout", -1),
    ("FTDDPStrategy", "comm_hook", "powersgd"),
    ("FTDDPStrategy", "comm_hook", "fp8"),
    ("FTDDPStrategy", "min_replica_size", 0),
    ("FTDDPStrategy", "static_graph", True),
    ("FTDDPStrategy", "ddp_comm_hook", print),
])
def test_a_bad_argument_is_refused_with_its_name(cls, arg, value):
    with pytest.raises((TypeError, ValueError), match=rf"{cls}: .*{arg}"):
        getattr(lightning_optim, cls)(**{arg: value})


@pytest.mark.parametrize("name", STRATEGIES)
def test_more_than_one_process_per_replica_is_refused_when_the_trainer_is_built(name):
    strategy = {"ft_diloco": lightning_optim.FTDiLoCoStrategy, "ft_ddp": lightning_optim.FTDDPStrategy}[name]
    with pytest.raises(ValueError, match=r"one process per replica group.*devices=2 x num_nodes=1 = 2 processes.*"
                                         r"launch 2 replica groups"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=strategy(replica_id="a", lighthouse="http://localhost:1"))


@pytest.mark.parametrize("name", STRATEGIES)
def test_the_replica_id_and_the_lighthouse_come_from_the_environment_or_are_asked_for(name, monkeypatch):
    for variable in ("REPLICA_ID", "TORCHFT_REPLICA_ID", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(ValueError, match=r"replica_id: give this replica group's name .* REPLICA_ID or "
                                         r"TORCHFT_REPLICA_ID"):
        pl.Trainer(accelerator="cpu", devices=1, strategy=name)
    monkeypatch.setenv("TORCHFT_REPLICA_ID", "a")
    with pytest.raises(ValueError, match=r"lighthouse: no Lighthouse address .*torchft_lighthouse --min_replicas 1"):
        pl.Trainer(accelerator="cpu", devices=1, strategy=name)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://localhost:1")
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=name, logger=False)
    assert trainer.strategy._replica_settings() == ("a", "http://localhost:1")


class _OnebitModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = network()

    def training_step(self, batch, batch_idx):
        return loss_of(self.net, *batch)

    def configure_optimizers(self):
        return lightning_optim.OnebitAdam(self.parameters(), lr=1e-3)


def test_a_communicating_optimizer_is_refused_by_ft_ddp_before_joining_the_replicas(tmp_path):
    # nothing listens at this address: the refusal comes before any connection to the Lighthouse
    strategy = lightning_optim.FTDDPStrategy(replica_id="a", lighthouse="http://localhost:1")
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path))
    data = torch.utils.data.DataLoader([pair for x, y in batches(0, 1) for pair in zip(x, y)], batch_size=4)
    with pytest.raises(ValueError, match=r"FTDDPStrategy: optimizer: OnebitAdam communicates by itself"):
        trainer.fit(_OnebitModule(), train_dataloaders=data)
    assert strategy.manager is None


def test_the_main_job_names_the_key_of_a_missing_replica_id_or_a_world_of_two(compose_train, monkeypatch, tmp_path):
    """The shipped options pass the up-front check (what is missing comes from the environment when the Trainer is
    built); building the Trainer then names the key, as the job reports it (one line, exit 2)."""
    from omegaconf import OmegaConf

    from lightning_optim.config_check import check_config, trainer_error
    from lightning_optim.train import build_trainer

    for variable in ("REPLICA_ID", "TORCHFT_REPLICA_ID", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(variable, raising=False)
    for option in STRATEGIES:
        cfg = OmegaConf.to_container(compose_train(f"strategy={option}", "trainer=smoke"), resolve=True)
        check_config(cfg)
        for change, key in (({}, "strategy.replica_id"), ({"replica_id": "a"}, "strategy.lighthouse"),
                            ({"replica_id": "a", "lighthouse": "local"}, None)):
            cfg["strategy"].update(change)
            for devices in (1, 2):
                cfg["trainer"]["devices"] = devices
                if key is None and devices == 1:
                    assert build_trainer(cfg, tmp_path, callbacks=[]).strategy.replica_id == "a"  # nothing started
                    continue
                with pytest.raises(ValueError) as info:
                    build_trainer(cfg, tmp_path, callbacks=[])
                expected = "trainer.devices" if devices == 2 else key
                assert str(trainer_error(cfg, info.value)).startswith(f"{expected}: "), (option, change, devices)


def test_the_main_job_refuses_a_communicating_optimizer_under_ft_ddp_up_front(compose_train):
    from omegaconf import OmegaConf

    from lightning_optim.config_check import ConfigError, check_config

    cfg = OmegaConf.to_container(compose_train("strategy=ft_ddp", "optimizer=onebit_adam"), resolve=True)
    with pytest.raises(ConfigError, match=r"^optimizer: lightning_optim.onebit.OnebitAdam communicates by itself"):
        check_config(cfg)

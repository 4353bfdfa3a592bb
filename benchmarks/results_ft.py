"""Results page section of ``benchmarks/fault_tolerance.py``: goodput with replicas killed, against a failure-free
run and a job that restarts from its checkpoints."""

from __future__ import annotations

import statistics

from results_format import f, pct, reading, table, x


def _mean(values: list) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.fmean(kept) if kept else None


def _max(values: list) -> float | None:
    kept = [v for v in values if v is not None]
    return max(kept) if kept else None


def _kill_row(r: dict) -> list:
    kills = r.get("per_kill", [])
    if "restarts" in r:  # the torchrun job
        return [r["label"], len(kills), f(_mean([k["to_next_step_s"] for k in kills]), 1),
                f(_max([k["to_next_step_s"] for k in kills]), 1), "-",
                f(_mean([k["lost_steps"] for k in kills]), 0) + " (whole job)",
                f(_mean([k["to_regain_s"] for k in kills]), 1)]
    return [r["label"], len(kills), f(_mean([k["to_next_commit_s"] for k in kills]), 1),
            f(_max([k["to_next_commit_s"] for k in kills]), 1), f(_max([k["extra_delay_s"] for k in kills]), 1),
            f(_mean([k["victim_lost_steps"] for k in kills]), 0) + " (killed replica)",
            f(_mean([k["back_in_s"] for k in kills]), 1)]


def fault_tolerance_body(rec: dict) -> list[str]:
    d = rec["data"]
    s, g = d["settings"], d["goals"]
    by = {r["key"]: r for r in d["rows"]}
    rows = [[r["label"] + ("" if r["finished"] else " (stopped by the deadline)"), r["kills"], f(r["wall_s"], 0),
             f(r["useful_tokens"] / 1e6, 2), f(r["goodput_tokens_per_s"], 0), x(r["goodput_vs_failure_free"], 3),
             f(r["final_val_loss"], 4), pct(r["loss_vs_failure_free_pct"], 2, sign=True),
             " / ".join(f(v, 2) for v in r["loadavg_1min"])] for r in d["rows"]]
    sizes = ", ".join(f"{k} {v}" for k, v in s["model_sizes"].items() if k != "dropout")
    method = (f"{s['replicas']} training processes (one torch thread each, on {s['cores']} cores), the main job's "
              f"`{s['model']}` ByteGPT ({sizes}), its data and AdamW, batch {s['batch_size']} x {s['seq_len']} = "
              f"{s['tokens_per_step']:,} tokens a step; DiLoCo (the main job's outer settings) synchronising every "
              f"{s['sync_every']} steps; every process saves a checkpoint every {s['checkpoint_every']} steps; every "
              f"variant trains to {s['steps']:,} inner steps. The fault-tolerant variants launch each replica on its "
              f"own (`DiLoCo(..., manager=replica_manager(...))`, a Lighthouse in the benchmark's process, "
              f"{s['min_replicas']} replicas at least in a quorum, join timeout {f(s['join_timeout_s'], 0)} s, "
              f"heartbeat timeout {f(s['heartbeat_timeout_s'], 0)} s); with failures, one replica is SIGKILLed every "
              f"{f(s['kill_every_s'], 0)} s (round robin) and relaunched at once: a peer heals it at the survivors' "
              "next synchronisation. The restart baseline runs the same ranks as one job, plain DiLoCo over gloo in "
              f"the same training loop, under `torchrun --standalone --max-restarts {s['max_restarts']}`; the same "
              "kills stop the whole job, and each restart resumes from the newest checkpoint every rank holds (a plain "
              "torch script with `torch.save`: the main job has no resume option).")
    goodput = ("Goodput = useful tokens / wall time (launch to the last inner step). Useful tokens are those of inner "
               "steps whose progress entered a committed outer step: each time a synchronisation commits with a "
               "replica's pseudo-gradient, the steps since that replica's last commit (or its join or heal) count; "
               "a killed replica's uncommitted steps and a restarted job's steps since its checkpoint do not. Final "
               "loss: the final model on the main job's validation windows. The variants run one after the other; "
             "the machine's 1-minute load average before and after each says what else ran.")
    per_kill = ("Per kill: the time to the next committed synchronisation of the survivors (fault-tolerant) or to "
                "the job's next inner step after its restart; the survivors' extra delay = their synchronisation "
                f"interval across the kill minus the median one ({f(d['sync_interval_s'], 1)} s); the steps lost; the "
                "time until the relaunched replica is back in a quorum, or until the restarted job is back at the "
                "step it was killed at.")
    lines = [method, "", goodput, "",
             *table(["variant", "kills", "wall s", "useful M tokens", "goodput tokens/s", "vs failure-free",
                     "final val loss", "vs failure-free", "load avg before / after"], rows, "lrrrrrrrr"),
             per_kill, "",
             *table(["variant", "kills", "to next commit / step, mean s", "max s", "survivors' extra delay, max s",
                     "steps lost, mean", "back / regained, mean s"],
                    [_kill_row(r) for r in d["rows"] if r.get("per_kill")], "lrrrrrr")]
    lines += reading(_reading(by, g, s))
    return lines


def _reading(by: dict, g: dict, s: dict) -> str:
    killed, restart = by.get("killed", {}), by.get("restart", {})
    extra = _max([k["extra_delay_s"] for k in killed.get("per_kill", [])])
    text = (f"With a replica killed every {f(s['kill_every_s'], 0)} s the fault-tolerant run kept "
            f"{pct(100 * killed['goodput_vs_failure_free'] if killed.get('goodput_vs_failure_free') else None, 0)} "
            f"of the failure-free goodput (goal 90%: {_met(g['goodput_met'])}); restarting from checkpoints under the "
            f"same kills kept "
            f"{pct(100 * restart['goodput_vs_failure_free'] if restart.get('goodput_vs_failure_free') else None, 0)} "
            f"(it replays the steps it lost, and ends {pct(restart.get('loss_vs_failure_free_pct'), 2, sign=True)} "
            "from the failure-free loss). "
            f"The final loss at equal steps was {pct(killed.get('loss_vs_failure_free_pct'), 2, sign=True)} from the "
            f"failure-free run's (goal within 2%: {_met(g['loss_met'])}). A kill delayed the survivors by at most "
            f"{f(extra, 1)} s beyond their usual interval, against the goal's bound of one interval plus the "
            f"heartbeat timeout, {f(g['kill_cost_bound_s'], 1)} s ({_met(g['kill_cost_met'])}).")
    if s["cores"] < s["replicas"]:
        text += (f" With fewer cores ({s['cores']}) than processes ({s['replicas']}), a dead replica's core goes to "
                 "the survivors while it is down, which flatters the runs with kills; a relaunch's start-up takes CPU "
                 "from them, which does the opposite.")
    return text


def _met(flag: bool | None) -> str:
    return "not measured" if flag is None else ("met" if flag else "not met")

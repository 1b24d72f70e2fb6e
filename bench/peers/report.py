"""The figures of bench/peers.py: per phase the median of the rounds and their spread (least and
greatest), GB/s of the model's bytes, peak resident memory per rank, the checkpoints on disk, and the
ratios against each peer; printed as a table or as one JSON object (--json)."""
import json
import statistics

GB = 1e9


class Report:
    def __init__(self):
        self.rows, self.extra = [], {}

    def add(self, name, value, spread=None, note="", target=None, met=None):
        self.rows.append({"name": name, "value": value, "spread": spread, "note": note, "target": target, "met": met})

    def set(self, key, value):
        self.extra[key] = value

    def rounds(self, phases):
        """Every round's seconds of every phase, in the JSON."""
        out = self.extra.setdefault("rounds", {})
        for name, rounds in phases.items():
            out[name] = [{k: v for k, v in r.items() if k in ("seconds", "total")} for r in rounds]

    def targets_met(self):
        return all(r["met"] is not False for r in self.rows)

    def to_json(self):
        out = dict(self.extra)
        out.update({r["name"]: r["value"] for r in self.rows})
        out["spread"] = {r["name"]: list(r["spread"]) for r in self.rows if r["spread"]}
        out["targets"] = {r["name"]: {"target": r["target"], "met": r["met"]}
                          for r in self.rows if r["met"] is not None}
        out["targets_met"] = self.targets_met()
        return json.dumps(out, indent=1)

    def print_table(self):
        print(f"  {'figure':<46} {'value':>14} {'spread (min-max)':>24}   {'target / note':<42} met")
        for r in self.rows:
            spread = f"{text(r['spread'][0])}-{text(r['spread'][1])}" if r["spread"] else ""
            met = "" if r["met"] is None else ("yes" if r["met"] else "NO")
            print(f"  {r['name']:<46} {text(r['value']):>14} {spread:>24}   {r['target'] or r['note']:<42} {met}")


def text(v):
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) >= 1000):
        return str(int(v))
    return f"{v:.3f}"


def seconds(phases, name, key="seconds"):
    return [r[key] for r in phases[name]]


def median_int(values):
    return int(statistics.median(values))


def add_phase(report, phases, name, nbytes, label):
    """`label`_s, _gbps (median and spread) and the peak memory of one phase."""
    s = seconds(phases, name)
    report.add(f"{label}_s", statistics.median(s), (min(s), max(s)))
    report.add(f"{label}_gbps", nbytes / statistics.median(s) / GB, (nbytes / max(s) / GB, nbytes / min(s) / GB))
    report.add(f"{label}_peak_extra_bytes", median_int(seconds(phases, name, "peak_extra")),
               note="per rank, above its RSS before")
    report.add(f"{label}_peak_rss_bytes", median_int(seconds(phases, name, "peak")), note="per rank, VmHWM")


def add_ratio(report, name, slow, fast, note, target=True):
    """median(slow seconds) / median(fast seconds), with the spread of the rounds' own ratios."""
    per_round = [a / b for a, b in zip(slow, fast)]
    value = statistics.median(slow) / statistics.median(fast)
    if target:
        report.add(name, value, (min(per_round), max(per_round)), target=f">= 1.0 ({note})", met=value >= 1.0)
    else:
        report.add(name, value, (min(per_round), max(per_round)), note=note)


def add_memory(report, phases, peer, ours, what, target=True):
    """The peer's peak memory per rank / ours (the extra resident bytes at the peak, medians); the
    target, against DCP: less than the peer."""
    theirs = median_int(seconds(phases, peer, "peak_extra"))
    mine = median_int(seconds(phases, ours, "peak_extra"))
    if target:
        report.add(f"{what}_peak_ratio", theirs / max(mine, 1), target="> 1.0 (peer's peak / ours)", met=mine < theirs)
    else:
        report.add(f"{what}_peak_ratio", theirs / max(mine, 1), note="peer's peak / ours")


def distributed(report, job, nbytes):
    ph = job["phases"]
    report.rounds(ph)
    for what in ("save", "load", "reshard"):
        for side in ("dcp", "shardckpt"):
            add_phase(report, ph, f"{side}_{what}", nbytes, f"{side}_{what}")
        add_ratio(report, f"dcp_{what}_ratio", seconds(ph, f"dcp_{what}"), seconds(ph, f"shardckpt_{what}"),
                  "shardckpt's GB/s / DCP's")
        add_memory(report, ph, f"dcp_{what}", f"shardckpt_{what}", f"dcp_{what}")
    for side in ("dcp", "shardckpt"):
        s, total = seconds(ph, f"{side}_async"), seconds(ph, f"{side}_async", "total")
        report.add(f"{side}_async_blocking_s", statistics.median(s), (min(s), max(s)))
        report.add(f"{side}_async_total_s", statistics.median(total), (min(total), max(total)), note="until done")
        report.add(f"{side}_async_peak_extra_bytes", median_int(seconds(ph, f"{side}_async", "peak_extra")),
                   note="per rank, until done")
        report.add(f"{side}_async_staging_bytes", job["staging"][side], note="all ranks, kept for the next save")
    add_ratio(report, "dcp_async_blocking_ratio", seconds(ph, "dcp_async"), seconds(ph, "shardckpt_async"),
              "DCP's blocking s / shardckpt's")
    for side in ("dcp", "shardckpt"):
        report.add(f"{side}_bytes_on_disk", job["disk"][side]["bytes"])
        report.add(f"{side}_files", job["disk"][side]["files"])


def single(report, one, nbytes):
    ph = one["phases"]
    report.rounds(ph)
    for name in ("safetensors_save", "shardckpt_single_save", "safetensors_load", "shardckpt_read"):
        add_phase(report, ph, name, nbytes, name)
    add_ratio(report, "safetensors_save_ratio", seconds(ph, "safetensors_save"), seconds(ph, "shardckpt_single_save"),
              "shardckpt's GB/s / safetensors'")
    add_ratio(report, "safetensors_load_ratio", seconds(ph, "safetensors_load"), seconds(ph, "shardckpt_read"),
              "shardckpt read / load_file")
    add_phase(report, ph, "mapping_populate", nbytes, "mapping_populate")
    add_ratio(report, "read_vs_mapping", seconds(ph, "mapping_populate"), seconds(ph, "shardckpt_read"),
              "the file's pages into a mapping, nothing checked / read", target=False)
    for name in ("safetensors_single_load_into", "shardckpt_single_load_into"):
        add_phase(report, ph, name, nbytes, name)
    add_ratio(report, "safetensors_load_into_ratio", seconds(ph, "safetensors_single_load_into"),
              seconds(ph, "shardckpt_single_load_into"), "load_into / load_file + copy_", target=False)
    add_memory(report, ph, "safetensors_save", "shardckpt_single_save", "safetensors_save", target=False)
    add_memory(report, ph, "safetensors_load", "shardckpt_read", "safetensors_load", target=False)
    for side in ("safetensors", "shardckpt"):
        report.add(f"{side}_single_bytes_on_disk", one["disk"][side]["bytes"])


def storage(report, runs):
    """DCP's FileSystemWriter/Reader against shardckpt.dcp's Writer/Reader under dcp.save/dcp.load:
    the interleaved rounds (times, per-phase peaks) and each storage alone (ru_maxrss)."""
    both = runs["storage"]
    ph, nbytes = both["phases"], both["bytes"]
    report.set("storage_state", {"bytes": nbytes, "layers": both["layers"], "hidden": both["hidden"],
                                 "ranks": both["ranks"],
                                 "rank_bytes": both["local_bytes"], "peak_memory_method": both["peak_method"]})
    report.rounds(ph)
    for what in ("save", "load"):
        for side in ("fs", "shardckpt"):
            add_phase(report, ph, f"storage_{side}_{what}", nbytes, f"dcp_storage_{side}_{what}")
        add_ratio(report, f"dcp_storage_{what}_ratio", seconds(ph, f"storage_fs_{what}"),
                  seconds(ph, f"storage_shardckpt_{what}"), "FileSystem s / shardckpt.dcp s")
    for side in ("fs", "shardckpt"):
        alone = runs[f"storage-{side}"]
        report.add(f"dcp_storage_{side}_maxrss_bytes", alone["maxrss"], note="per rank, ru_maxrss, this storage alone")
        report.add(f"dcp_storage_{side}_maxrss_extra_bytes", alone["maxrss_extra"],
                   note="per rank, ru_maxrss above RSS before its first phase")
        report.set(f"dcp_storage_{side}_alone_rss_before", {"rss": alone["rss_before"], "hwm": alone["hwm_before"]})
        report.add(f"dcp_storage_{side}_bytes_on_disk", both["disk"][side]["bytes"])
        report.add(f"dcp_storage_{side}_files", both["disk"][side]["files"])


def megatron(report, runs):
    """Megatron's torch_dist (alone, and in FullyParallelSaveStrategyWrapper) against the "shardckpt"
    backend under dist_checkpointing.save / load: times, per-phase peaks, each alone (ru_maxrss), disk."""
    both = runs["megatron"]
    ph, nbytes = both["phases"], both["bytes"]
    report.set("megatron_state", {"bytes": nbytes, "layers": both["layers"], "hidden": both["hidden"],
                                  "ranks": both["ranks"], "layout": "TP 2 x DP (ranks / 2)",
                                  "rank_bytes": both["local_bytes"], "peak_memory_method": both["peak_method"]})
    report.rounds(ph)
    for side in ("torch_dist", "torch_dist_fp", "shardckpt"):
        add_phase(report, ph, f"megatron_{side}_save", nbytes, f"megatron_{side}_save")
    for side in ("torch_dist", "shardckpt"):
        add_phase(report, ph, f"megatron_{side}_load", nbytes, f"megatron_{side}_load")
    add_ratio(report, "megatron_save_ratio", seconds(ph, "megatron_torch_dist_save"),
              seconds(ph, "megatron_shardckpt_save"), "torch_dist s / shardckpt s")
    add_ratio(report, "megatron_fp_save_ratio", seconds(ph, "megatron_torch_dist_fp_save"),
              seconds(ph, "megatron_shardckpt_save"), "torch_dist fully parallel s / shardckpt s")
    add_ratio(report, "megatron_load_ratio", seconds(ph, "megatron_torch_dist_load"),
              seconds(ph, "megatron_shardckpt_load"), "torch_dist s / shardckpt s")
    if "megatron_shardckpt_async_save" in ph:  # megatron-core 0.18 and later: async saves through its queue
        for side in ("torch_dist_async", "shardckpt_async"):
            add_phase(report, ph, f"megatron_{side}_save", nbytes, f"megatron_{side}_save")
            b = seconds(ph, f"megatron_{side}_blocking")
            report.add(f"megatron_{side}_blocking_s", statistics.median(b), (min(b), max(b)),
                       note="the caller's wait: dist_checkpointing.save and schedule_async_request, slowest rank")
        add_ratio(report, "megatron_async_blocking_ratio", seconds(ph, "megatron_torch_dist_async_blocking"),
                  seconds(ph, "megatron_shardckpt_async_blocking"), "torch_dist's blocking s / shardckpt's")
        add_ratio(report, "megatron_async_save_ratio", seconds(ph, "megatron_torch_dist_async_save"),
                  seconds(ph, "megatron_shardckpt_async_save"), "torch_dist s / shardckpt s, to the finalization")
    for side in ("torch_dist", "shardckpt"):
        alone = runs[f"megatron-{side}"]
        report.add(f"megatron_{side}_maxrss_extra_bytes", alone["maxrss_extra"],
                   note="per rank, ru_maxrss above RSS before, this backend alone")
    for side in [s for s in ("torch_dist", "torch_dist_fp", "shardckpt") if s in both["disk"]]:
        report.add(f"megatron_{side}_bytes_on_disk", both["disk"][side]["bytes"])
        report.add(f"megatron_{side}_files", both["disk"][side]["files"])


def mamba(report, run):
    """shardckpt.megatron.no_gather against Megatron's own gather of a GTP-sharded MambaMixer in_proj,
    both saved by the "shardckpt" backend: save time (sharded_state_dict() and dist_checkpointing.save),
    the peak memory each adds per rank, the bytes of the state dict's tensors that are not the model's."""
    ph = run["phases"]
    report.set("mamba_state", {k: run[k] for k in ("dims", "rows", "cols", "blocks", "gtp", "tp", "align",
                                                   "shard_rows", "pad_rows", "ranks", "megatron_core")}
               | {"layout": f"TP 1 x GTP {run['gtp']}, alignment {run['align']}, {run['ranks']} gloo processes",
                  "rank_bytes": run["local_bytes"], "peak_memory_method": run["peak_method"]})
    report.rounds(ph)
    report.add("mamba_model_bytes_per_rank", max(run["local_bytes"]), note="the mixer's parameters, largest rank")
    report.add("mamba_in_proj_bytes", run["in_proj_bytes"], note="in_proj TP-local (what the gather builds)")
    report.add("mamba_in_proj_shard_bytes", run["shard_bytes"], note="in_proj's GTP shard per rank, pad rows in")
    extra = {}
    for side in ("gather", "no_gather"):
        for what in ("save", "state_dict"):
            name = f"mamba_{side}_{what}"
            s, peaks = seconds(ph, name), seconds(ph, name, "peak_extra")
            report.add(f"{name}_s", statistics.median(s), (min(s), max(s)))
            report.add(f"{name}_peak_extra_bytes" if what == "state_dict" else f"mamba_{side}_peak_extra_bytes",
                       median_int(peaks), (min(peaks), max(peaks)), note="per rank (largest), above RSS before")
        extra[side] = median_int(seconds(ph, f"mamba_{side}_save", "peak_extra"))
        report.add(f"mamba_{side}_state_dict_bytes", run["state_dict_extra_bytes"][side],
                   note="state dict tensors not the model's memory")
    add_ratio(report, "mamba_no_gather_save_ratio", seconds(ph, "mamba_gather_save"),
              seconds(ph, "mamba_no_gather_save"), "gather s / no_gather s")
    add_ratio(report, "mamba_no_gather_state_dict_ratio", seconds(ph, "mamba_gather_state_dict"),
              seconds(ph, "mamba_no_gather_state_dict"), "gather s / no_gather s", target=False)
    fraction = extra["no_gather"] / max(extra["gather"], 1)
    report.add("mamba_no_gather_memory_fraction", fraction, target="<= 0.01 (no_gather's peak extra / gather's)",
               met=fraction <= 0.01)
    built = run["state_dict_extra_bytes"]
    # gloo's all_gather_into_tensor stages a second copy of the gathered weight (NCCL's gathers in
    # place): against the gathered tensor alone, what the gather adds on a GPU.
    report.add("mamba_no_gather_memory_fraction_of_gathered", extra["no_gather"] / max(built["gather"], 1),
               note="no_gather's peak extra / the gathered weight's bytes")
    report.add("mamba_no_gather_state_dict_fraction", built["no_gather"] / max(built["gather"], 1),
               note="no_gather's state dict bytes / gather's")
    for side in ("gather", "no_gather"):
        report.add(f"mamba_{side}_bytes_on_disk", run["disk"][side]["bytes"])
    report.add("mamba_datasets_compared", run["datasets_compared"], note="h5py: both checkpoints, byte for byte")

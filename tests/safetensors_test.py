#!/usr/bin/python3
"""adopt meets PyTorch's files: .safetensors files written by Hugging Face's own safetensors package
(from PyPI, in the virtual environment scripts/safetensors-venv.sh makes; bf16 through Debian's
torch, f32 and i64 through numpy) are adopted without a copy: a fused in_proj becomes its blocks, a
plain weight stays one dataset, and --common values become common values. The adopted checkpoint is
inspected, verified, loaded and resharded at other TP and GTP, and every value is compared with what
safetensors reads back from its own file. Hostile files (bad header lengths, offsets out of range,
overlapping tensors, unknown dtypes, shapes that do not match their bytes, duplicate keys, a link or
a FIFO planted in place of the file) are refused with one clear error line.

Usage: safetensors_test.py SHARDCKPT_EXE VENV_DIR. Exit 77 (skipped) when the virtual environment
cannot be made (no python3-venv, no network to PyPI)."""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tally import check, finish  # noqa: E402

exe, venv = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
if os.environ.get("SHARDCKPT_SAFETENSORS_VENV") != venv:
    # Started by the system Python: make the environment (idempotent), then run again inside it.
    here = os.path.dirname(os.path.abspath(__file__))
    made = subprocess.run(["bash", os.path.join(here, "..", "scripts", "safetensors-venv.sh"), venv],
                          capture_output=True, text=True)
    py = os.path.join(venv, "bin", "python")
    if made.returncode != 0 or subprocess.run([py, "-c", "import safetensors, torch, numpy, h5py"],
                                              capture_output=True).returncode != 0:
        print(f"SKIP: no virtual environment with safetensors at {venv}: {made.stderr.strip()}")
        sys.exit(77)
    os.environ["SHARDCKPT_SAFETENSORS_VENV"] = venv
    os.execv(py, [py, os.path.abspath(__file__)] + sys.argv[1:])

import h5py  # noqa: E402
import numpy as np  # noqa: E402
import safetensors  # noqa: E402
import safetensors.numpy  # noqa: E402
import safetensors.torch  # noqa: E402
import torch  # noqa: E402

work = tempfile.mkdtemp(prefix="safetensors-test-")
print(f"safetensors {safetensors.__version__}, torch {torch.__version__}, numpy {np.__version__}")


def tool(*args, timeout=120):
    try:
        return subprocess.run([exe, "--quiet", *args], capture_output=True, text=True, errors="replace",
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(args, None, "", f"timed out after {timeout} s")


def expect(r, rc, what):
    check(r.returncode == rc, f"{what}: exit {r.returncode}, not {rc}: {r.stderr.strip()[-600:]}")
    return r.returncode == rc


def header_of(path):
    """The header as safetensors wrote it (N, the JSON) and where its data begins."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), 8 + n


def record(key, blocks, trailing, axis="rows"):
    return {"key": key, "tp_axis": axis, "blocks": [{"name": n, "rows": r} for n, r in blocks], "trailing": trailing}


# ---- the models: a GDP-like fused in_proj (bf16, torch) and a Mamba-like one (f32, numpy) ------------------
GDP = [("z", 32), ("V0", 32), ("V1", 32), ("K0", 16), ("K1", 16), ("Q", 16), ("b0", 4), ("b1", 4), ("a", 4)]
MAMBA = [("z", 16), ("x", 16), ("B", 8), ("C", 8), ("dt", 4)]
COLS = 512
torch.manual_seed(7)
torch_tensors = {
    "model.layers.0.mixer.in_proj.weight": torch.randn(sum(r for _, r in GDP), COLS).to(torch.bfloat16),
    "model.layers.0.mixer.out_proj.weight": torch.randn(COLS, 64).to(torch.bfloat16),  # row-parallel
    "model.embed.weight": torch.randn(64, COLS).to(torch.bfloat16),
    "model.norm.weight": torch.randn(COLS),  # f32, no record: a replicated plain weight
    "optimizer.step": torch.tensor(0.5),  # a 0-d tensor (shape []): a scalar dataset
}
torch_records = [record("model.layers.0.mixer.in_proj.weight", GDP, [COLS]),
                 record("model.layers.0.mixer.out_proj.weight", [("", COLS)], [64], "cols"),
                 record("model.embed.weight", [("", 64)], [COLS])]
rng = np.random.default_rng(3)
numpy_tensors = {
    "mamba.in_proj.weight": rng.standard_normal((sum(r for _, r in MAMBA), COLS)).astype(np.float32),
    "mamba.conv.weight": rng.standard_normal((40, 1, 4)).astype(np.float32),
    "counts": np.arange(-5, 7, dtype=np.int64),
    "bn.num_batches_tracked": np.array(12, dtype=np.int64),  # shape []: a scalar dataset
}
numpy_records = [record("mamba.in_proj.weight", MAMBA, [COLS])]

models = os.path.join(work, "models")
os.mkdir(models)
torch_file, numpy_file = os.path.join(models, "gdp.safetensors"), os.path.join(models, "mamba.safetensors")
safetensors.torch.save_file(torch_tensors, torch_file, metadata={"format": "pt"})
safetensors.numpy.save_file(numpy_tensors, numpy_file, metadata={"written_by": "numpy"})
for name, recs in [("gdp", torch_records), ("mamba", numpy_records)]:
    json.dump(recs, open(os.path.join(models, name + ".json"), "w"))


def expected_values(path, records):
    """Every dataset the adopted checkpoint should hold, as float64 (or int64) arrays, from what
    safetensors itself reads back of its file: each fused tensor cut into its blocks' rows."""
    loaded = {k: v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy()
              for k, v in safetensors.torch.load_file(path).items()}
    fused = {r["key"]: r for r in records if r["blocks"][0]["name"]}
    out = {}
    for key, value in loaded.items():
        if key not in fused:
            out[key] = value
            continue
        first = 0
        for b in fused[key]["blocks"]:
            out[key + "." + b["name"]] = value[first:first + b["rows"]]
            first += b["rows"]
    return out


def same_values(h5path, want, what, cwd=None):
    old = os.getcwd()
    os.chdir(cwd or old)
    try:
        with h5py.File(h5path, "r") as f:
            keys = sorted(k for k in f if not k.startswith("_"))
            check(keys == sorted(want), f"{what}: keys {keys}, not {sorted(want)}")
            for k in want:
                if k in f:
                    got = f[k][...]
                    check(got.shape == want[k].shape and (got == want[k]).all(), f"{what}: values of {k} differ")
    finally:
        os.chdir(old)


def no_copy(path, ckpt, records):
    """The checkpoint points into the .safetensors file (one external file per dataset, at the byte
    the header gives plus the block's rows) and holds none of its bytes."""
    header, data = header_of(path)
    fused = {r["key"]: r for r in records if r["blocks"][0]["name"]}
    want = {}
    for key, h in header.items():
        if key == "__metadata__":
            continue
        begin, end = h["data_offsets"]
        if key not in fused:
            want[key] = [(os.path.basename(path), data + begin, end - begin)]
            continue
        row = (end - begin) // h["shape"][0]
        first = 0
        for b in fused[key]["blocks"]:
            want[key + "." + b["name"]] = [(os.path.basename(path), data + begin + first * row, b["rows"] * row)]
            first += b["rows"]
    with h5py.File(ckpt, "r") as f:
        got = {k: f[k].external for k in f if not k.startswith("_")}
    check(got == want, f"{ckpt}: external storage {got}, not {want}")
    size, payload = os.path.getsize(ckpt), os.path.getsize(path) - data
    check(size < payload / 4, f"{ckpt} has {size} bytes for {payload} bytes of tensors: data was copied")
    blob = open(ckpt, "rb").read()
    with open(path, "rb") as f:
        for key, h in header.items():
            if key != "__metadata__" and h["data_offsets"][1] - h["data_offsets"][0] >= 64:
                f.seek(data + h["data_offsets"][0])
                check(f.read(64) not in blob, f"{ckpt} holds bytes of {key}")


def adopt_and_check(path, records, dtypes):
    name = os.path.basename(path).split(".")[0]
    cfg, ckpt = os.path.join(models, name + ".json"), os.path.join(models, name + ".shardckpt.h5")
    r = tool("adopt", path, "--model-config", cfg, "--common", "step=100", "--common", "lr=0.001",
             "--common", "name=run7", "--common", 'tag="42"', "--json")
    if not expect(r, 0, f"adopt {name}"):
        return
    rep = json.loads(r.stdout)
    check(rep["fused"] == 1 and rep["out"] == ckpt, f"adopt {name}: {rep}")
    no_copy(path, ckpt, records)
    want = expected_values(path, records)
    common = {"step": 100, "lr": 0.001, "name": "run7", "tag": "42"}
    r = tool("inspect", ckpt, "--json")
    if expect(r, 0, f"inspect {name}"):
        j = json.loads(r.stdout)
        check(j["common"] == common and type(j["common"]["step"]) is int, f"inspect {name}: common {j['common']}")
        got = {t["key"]: (t["dtype"], t["global_shape"]) for t in j["tensors"]}
        check(got == {k: (dtypes[k.rsplit(".", 1)[0] if k not in dtypes else k], list(v.shape))
                      for k, v in want.items()}, f"inspect {name}: tensors {got}")
    expect(tool("verify", ckpt), 0, f"verify {name}")
    for layout in (["--tp", "2", "--gtp", "3", "--align", "8"], ["--tp", "4", "--gtp", "2", "--align", "16"]):
        r = tool("load", ckpt, *layout, "--json")
        if expect(r, 0, f"load {name} at {layout}"):
            j = json.loads(r.stdout)
            check(j["checksums_checked"] and j["common"] == common, f"load {name} at {layout}: {j}")
    for tp, gtp, align in [("2", "2", "16"), ("4", "3", "8")]:
        out = os.path.join(models, f"{name}-tp{tp}-gtp{gtp}.h5")
        if expect(tool("reshard", ckpt, out, "--tp", tp, "--gtp", gtp, "--align", align), 0, f"reshard {name}"):
            same_values(out, want, f"{name} resharded at TP {tp} x GTP {gtp}")
            expect(tool("load", out, "--tp", "1", "--gtp", "1", "--align", "0"), 0, f"load {name} resharded")
    # h5py follows the external storage itself (names resolve in the current directory): the same values.
    same_values(ckpt, want, f"{name} read by h5py", cwd=models)
    print(f"{name}: adopted {len(want)} tensors (fused, plain, {', '.join(sorted(set(dtypes.values())))}), "
          "loaded, verified and resharded")


adopt_and_check(torch_file, torch_records, {"model.layers.0.mixer.in_proj.weight": "bf16",
                                            "model.layers.0.mixer.out_proj.weight": "bf16",
                                            "model.embed.weight": "bf16", "model.norm.weight": "f32",
                                            "optimizer.step": "f32"})
adopt_and_check(numpy_file, numpy_records, {"mamba.in_proj.weight": "f32", "mamba.conv.weight": "f32",
                                            "counts": "i64", "bn.num_batches_tracked": "i64"})

# A changed byte of the .safetensors file is a checksum mismatch naming its block and row.
tampered = os.path.join(work, "tampered")
os.mkdir(tampered)
shutil.copy(torch_file, tampered)
shutil.copy(os.path.join(models, "gdp.json"), tampered)
t = os.path.join(tampered, "gdp.safetensors")
if expect(tool("adopt", t, "--model-config", os.path.join(tampered, "gdp.json")), 0, "adopt the copy"):
    header, data = header_of(t)
    at = data + header["model.layers.0.mixer.in_proj.weight"]["data_offsets"][0] + 33 * COLS * 2  # V0, row 1
    with open(t, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 1]))
    r = tool("verify", os.path.join(tampered, "gdp.shardckpt.h5"))
    check(r.returncode == 1 and "in_proj.weight.V0, rows [1, 2)" in r.stderr, f"tampered byte: {r.returncode} {r.stderr}")

# ---- hostile files: each refused with one error line naming the file and what is wrong; nothing written ----
hostile = os.path.join(work, "hostile")
os.mkdir(hostile)
original = open(torch_file, "rb").read()
header, data = header_of(torch_file)
payload = original[data:]
IN, EMB = "model.layers.0.mixer.in_proj.weight", "model.embed.weight"


def with_header(text, n=None):
    return struct.pack("<Q", len(text) if n is None else n) + text + payload


def edited(change):
    h = json.loads(json.dumps(header))
    change(h)
    return with_header(json.dumps(h).encode())


def set_offsets(h, key, begin):
    size = h[key]["data_offsets"][1] - h[key]["data_offsets"][0]
    h[key]["data_offsets"] = [begin, begin + size]


text = json.dumps(header).encode()
cases = [
    ("a header length past the end of the file", with_header(text, n=len(text) + len(payload) + 1),
     f"bytes, but only {len(text) + len(payload)} follow it"),
    ("a header length of 0", with_header(text, n=0), "too short for a JSON object"),
    ("a header length of 2^64 - 1", with_header(text, n=2**64 - 1), "more than the limit of 100000000"),
    ("a header length that cuts the JSON", with_header(text, n=len(text) - 3), "its header is not valid JSON"),
    ("offsets out of range", edited(lambda h: set_offsets(h, IN, len(payload) + 8)), "reach past the data"),
    ("overlapping tensors", edited(lambda h: set_offsets(h, EMB, h[IN]["data_offsets"][0] + 2)), "share bytes"),
    ("an unknown dtype", edited(lambda h: h[IN].update(dtype="F8_E4M3")), '"F8_E4M3", which shardckpt does not store'),
    ("a shape that does not match its bytes", edited(lambda h: h[IN]["shape"].__setitem__(0, 157)),
     f"of shape [157, {COLS}] and dtype BF16 has"),
    ("a duplicate key", with_header(text[:-1] + b', "' + EMB.encode() + b'": ' + json.dumps(header[EMB]).encode() + b"}"),
     f'the key "{EMB}" appears twice'),
    ("a tensor named like the library's metadata", edited(lambda h: h.update(_shardckpt=h.pop(EMB))),
     "must be non-empty, contain no '/' and not start with '_'"),
    ("a scalar of more bytes than one element", edited(lambda h: h["optimizer.step"].update(data_offsets=[0, 8])),
     "of shape [] and dtype F32 has 4 bytes"),
    ("9 dimensions", edited(lambda h: h[EMB].update(shape=[1] * 8 + [64 * COLS])), "has 9 dimensions"),
    ("a file of 3 bytes", b"\x10\0\0", "neither an HDF5 file"),
]
bad = os.path.join(hostile, "bad.safetensors")
cfg = os.path.join(models, "gdp.json")


def refused(r, what, phrase, name):
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    check(r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"shardckpt: error: adopting {name}") and
          phrase in lines[0], f"{what}: exit {r.returncode}, stderr {r.stderr.strip()[-600:]!r}, not one line with {phrase!r}")
    left = [e for e in os.listdir(hostile) if e.endswith(".partial") or e.endswith(".h5")]
    check(not left, f"{what}: left {left}")
    for e in left:
        os.unlink(os.path.join(hostile, e))


for what, blob, phrase in cases:
    with open(bad, "wb") as f:
        f.write(blob)
    refused(tool("adopt", bad, "--model-config", cfg, timeout=30), what, phrase, bad)
os.unlink(bad)

# Links and FIFOs where the file should be: at adoption, and planted after it beside the checkpoint.
os.symlink("/dev/zero", bad)
refused(tool("adopt", bad, "--model-config", cfg, timeout=30), "a link to /dev/zero", "is a character device, not a regular file", bad)
os.unlink(bad)
os.mkfifo(bad)
refused(tool("adopt", bad, "--model-config", cfg, timeout=30), "a FIFO", "is a FIFO, not a regular file", bad)
os.unlink(bad)
planted = os.path.join(hostile, "planted")
os.mkdir(planted)
good = os.path.join(planted, "gdp.safetensors")
shutil.copy(torch_file, good)
ckpt = os.path.join(planted, "gdp.shardckpt.h5")
if expect(tool("adopt", good, "--model-config", cfg), 0, "adopt for the planted files"):
    shutil.move(good, good + ".real")
    for what, plant, phrase in [
            ("a symbolic link to the same bytes", lambda: os.symlink("gdp.safetensors.real", good),
             "gdp.safetensors is a symbolic link, which is not followed"),
            ("a symbolic link to /etc/passwd", lambda: os.symlink("/etc/passwd", good), "is a symbolic link"),
            ("a FIFO", lambda: os.mkfifo(good), "gdp.safetensors is a FIFO, not a regular file")]:
        plant()
        r = tool("load", ckpt, "--tp", "2", "--gtp", "2", "--align", "8", timeout=30)
        check(r.returncode == 2 and phrase in r.stderr, f"{what} planted beside the checkpoint: exit {r.returncode}: {r.stderr}")
        os.unlink(good)
    shutil.move(good + ".real", good)
    expect(tool("load", ckpt, "--tp", "2", "--gtp", "2", "--align", "8"), 0, "the file put back loads again")
print(f"hostile: {len(cases)} malformed headers, links and FIFOs refused")

shutil.rmtree(work)
finish("safetensors")

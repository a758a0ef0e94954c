"""load_offloaded's checkpoint reading: safetensors headers are checked at least as
strictly as the safetensors library checks them, and an index JSON may only name
regular files inside its own folder. Every refusal is a ValueError naming the file
(and the tensor or shard), raised before the model changes."""
import json
import os
import struct
import threading

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import layerwise
from layerwise.formats.safetensors import checkpoint_files as _checkpoint_files
from layerwise.formats.safetensors import read_header as _read_header

from helpers.models import TwoGroupModel

GROUPS = ["transformer_blocks", "single_transformer_blocks"]


# ---------------------------------------------------------------- helpers

def write_raw(path, header, data=b"", n=None):
    """A file laid out as safetensors: u64 header length `n` (default: the real one),
    the header (a dict, dumped as JSON, or raw bytes), then `data`."""
    hb = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb) if n is None else n))
        f.write(hb)
        f.write(data)
    return str(path)


def e(begin, end, dtype="F32", shape=(4,)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


def untouched(model):
    return all(p.is_meta for p in model.parameters()) and "_layerwise_managers" not in model.__dict__


def empty_model():
    """TwoGroupModel without weights: parameters on meta, buffers on the host."""
    with torch.device("meta"):
        model = TwoGroupModel()
    for mod in model.modules():
        for k, b in mod._buffers.items():
            mod._buffers[k] = torch.linspace(0.5, 1.5, b.shape[0])
    return model


def without_hanging(fn, *args, fifos=(), seconds=10):
    """fn(*args) in a thread; fails (instead of hanging CI) if it is still running after
    `seconds`, e.g. blocked opening a FIFO: it is then unblocked by opening the FIFOs'
    write ends. Returns the exception fn raised (None if it returned)."""
    box = {}

    def run():
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        t.join(5)
        pytest.fail(f"still running after {seconds} s: it opened a FIFO and blocked")
    return box.get("error")


def assert_refused(call, match, *names):
    with pytest.raises(ValueError, match=match) as info:
        call()
    for name in names:
        assert str(name) in str(info.value), (name, str(info.value))
    return str(info.value)


def safetensors_refuses(path):
    with pytest.raises(Exception):
        with safe_open(path, "pt") as f:
            for k in f.keys():
                f.get_tensor(k)


# ---------------------------------------------------------------- headers

D16 = bytes(range(16))
ONE = json.dumps({"a": e(0, 16)}).encode()  # a valid header for 16 bytes of data

# (header, data, header length or None for the real one, what the message says, tensor it names)
MALFORMED = {
    "two tensors on the same bytes": ({"a": e(0, 16), "b": e(0, 16)}, D16, None, "overlap tensor 'a'", "b"),
    "negative offset": ({"a": e(-4, 12)}, D16, None, "data_offsets", "a"),
    "every tensor shifted by 4 bytes": ({"a": e(4, 20), "b": e(20, 36)}, bytes(36), None,
                                        r"bytes \[0, 4\) .* belong to no tensor", "a"),
    "overlap": ({"a": e(0, 16), "b": e(8, 24)}, bytes(24), None, "overlap tensor 'a'", "b"),
    "gap in the middle": ({"a": e(0, 16), "b": e(20, 36)}, bytes(36), None,
                          r"bytes \[16, 20\) .* belong to no tensor", "b"),
    "end past the data section": ({"a": e(0, 16), "b": e(16, 32)}, bytes(24), None,
                                  "past the data section, which has 24 bytes", "b"),
    "trailing bytes": ({"a": e(0, 16)}, bytes(20), None, "4 trailing bytes", None),
    "trailing bytes, no tensors": ({}, bytes(3), None, "3 trailing bytes", None),
    "header not UTF-8": (b'{"a\xff\xfe": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}', D16, None,
                         "not UTF-8", None),
    "header not JSON": (b'{"a": {"dtype": "F32", "sha', D16, None, "not valid JSON", None),
    "header a JSON list": (b"[]", b"", None, "JSON list, not an object", None),
    "header a JSON string": (b'"a"', b"", None, "JSON str, not an object", None),
    "header nested too deeply": (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"", None,
                                 "nested too deeply", None),
    "entry not an object": ({"a": [0, 16]}, D16, None, "not an object", "a"),
    "entry missing data_offsets": ({"a": {"dtype": "F32", "shape": [4]}}, D16, None, "no 'data_offsets'", "a"),
    "entry missing dtype": ({"a": {"shape": [4], "data_offsets": [0, 16]}}, D16, None, "no 'dtype'", "a"),
    "data_offsets with 3 values": ({"a": {**e(0, 16), "data_offsets": [0, 8, 16]}}, D16, None, "data_offsets",
                                   "a"),
    "data_offsets with 1 value": ({"a": {**e(0, 16), "data_offsets": [16]}}, D16, None, "data_offsets", "a"),
    "data_offsets not a list": ({"a": {**e(0, 16), "data_offsets": "0-16"}}, D16, None, "data_offsets", "a"),
    "offsets at 2**64": ({"a": e(2**64, 2**64 + 16)}, D16, None, "below 2\\*\\*64", "a"),
    "offsets far past 2**64": ({"a": e(0, 2**70)}, D16, None, "below 2\\*\\*64", "a"),
    "offset a float": ({"a": e(0, 16.0)}, D16, None, "data_offsets", "a"),
    "offset a bool": ({"a": e(False, 16)}, D16, None, "data_offsets", "a"),
    "end before begin": ({"a": e(16, 0, shape=(0,))}, D16, None, "end before they begin", "a"),
    "unknown dtype": ({"a": e(0, 16, dtype="F17")}, D16, None, "unknown dtype 'F17'", "a"),
    "dtype not a string": ({"a": e(0, 16, dtype=32)}, D16, None, "unknown dtype 32", "a"),
    "shape with a negative": ({"a": e(0, 16, shape=(-1, -4))}, D16, None, "shape", "a"),
    "shape with a float": ({"a": e(0, 16, shape=(4.0,))}, D16, None, "shape", "a"),
    "shape with a bool": ({"a": e(0, 16, shape=(True, 4))}, D16, None, "shape", "a"),
    "shape not a list": ({"a": {**e(0, 16), "shape": 4}}, D16, None, "shape", "a"),
    "shape overflows 64 bits": ({"a": e(0, 16, shape=(2**40, 2**40, 0))}, D16, None, "64 bits", "a"),
    "nbytes not shape times itemsize": ({"a": e(0, 12, shape=(2, 2))}, bytes(12), None,
                                        "hold 12 bytes but shape .* needs 16", "a"),
    "sub-byte dtype, odd count": ({"a": e(0, 1, dtype="F4", shape=(3,))}, bytes(1), None,
                                  "not a whole number of bytes", "a"),
    "__metadata__ not str to str": ({"__metadata__": {"format": 1}, "a": e(0, 16)}, D16, None, "__metadata__",
                                    None),
    "__metadata__ a list": ({"__metadata__": ["pt"], "a": e(0, 16)}, D16, None, "__metadata__", None),
    "header length before the end of the header": (ONE, D16, 20, "not valid JSON", None),
    "header length past the header, into the data": (ONE, D16, len(ONE) + 8, "not valid JSON", None),
    "header length past the end of the file": ({"a": e(0, 16)}, D16, 10_000, "past the end of the file", None),
    "header length over 100 MB": ({"a": e(0, 16)}, D16, 2**63, "over the 100000000-byte limit", None),
    "empty file": (b"", b"", 0, "shorter than its 8-byte header length", None),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_header_is_a_named_value_error(tmp_path, case):
    header, data, n, match, key = MALFORMED[case]
    path = str(tmp_path / "bad.safetensors")
    if case == "empty file":
        open(path, "wb").close()
    else:
        write_raw(path, header, data, n)
    msg = assert_refused(lambda: _read_header(path), match, path, *([repr(key)] if key else []))
    assert "not a safetensors file" in msg
    safetensors_refuses(path)  # the library refuses it too: we are at least as strict


def test_a_key_twice_is_refused(tmp_path):
    # json (and the safetensors library) would keep the last one silently; refused here.
    hb = b'{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},' \
         b' "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}'
    path = write_raw(tmp_path / "dup.safetensors", hb, D16)
    assert_refused(lambda: _read_header(path), "the key 'a' twice", path)


def test_crafted_valid_file_is_accepted_by_both(tmp_path):
    # The writer of the malformed cases makes valid files when asked: zero-size
    # tensors (begin == end) at the start, in the middle and at the end, a header
    # padded with spaces, metadata, and a sub-byte dtype.
    header = {"__metadata__": {"format": "pt"}, "z0": e(0, 0, shape=(0, 4)), "a": e(0, 16),
              "z1": e(16, 16, dtype="BF16", shape=(3, 0)), "b": e(16, 24, dtype="I16", shape=(2, 2)),
              "f4": e(24, 26, dtype="F4", shape=(4,)), "z2": e(26, 26, shape=(0,))}
    hb = json.dumps(header).encode() + b"      "
    path = write_raw(tmp_path / "ok.safetensors", hb, bytes(range(26)))
    with safe_open(path, "pt") as f:
        assert set(f.keys()) == {"z0", "a", "z1", "b", "f4", "z2"}
    stored = _read_header(path)
    assert set(stored) == {"z0", "a", "z1", "b", "f4", "z2"}
    n = len(hb)
    assert (stored["a"].start, stored["a"].nbytes, stored["a"].dtype) == (8 + n, 16, torch.float32)
    assert (stored["b"].start, stored["b"].nbytes, stored["b"].shape) == (8 + n + 16, 8, (2, 2))
    assert (stored["z1"].nbytes, stored["z1"].shape, stored["z1"].dtype) == (0, (3, 0), torch.bfloat16)
    assert stored["f4"].dtype == "F4"  # known to the format, not loadable by layerwise (said when needed)


def test_file_written_by_safetensors_reads_back(tmp_path):
    tensors = {"w": torch.randn(3, 5), "h": torch.randn(7).to(torch.bfloat16), "empty": torch.zeros(0, 4),
               "i": torch.arange(3), "flag": torch.tensor([True, False])}
    path = str(tmp_path / "saved.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    stored = _read_header(path)
    assert set(stored) == set(tensors)
    with open(path, "rb") as f:
        for k, t in tensors.items():
            s = stored[k]
            assert (s.dtype, s.shape, s.nbytes) == (t.dtype, tuple(t.shape), t.numel() * t.element_size()), k
            f.seek(s.start)
            got = torch.frombuffer(bytearray(f.read(s.nbytes)), dtype=t.dtype) if s.nbytes else t.new_empty(0)
            assert torch.equal(got.view(t.shape), t), k


def test_fifo_or_directory_as_the_file_is_refused_without_opening(tmp_path):
    fifo = str(tmp_path / "fifo.safetensors")
    os.mkfifo(fifo)
    error = without_hanging(_read_header, fifo, fifos=[fifo])
    assert isinstance(error, ValueError) and fifo in str(error) and "FIFO" in str(error), error
    for call in (lambda: _checkpoint_files(fifo), lambda: _checkpoint_files([fifo])):
        error = without_hanging(call, fifos=[fifo])
        assert isinstance(error, ValueError) and fifo in str(error) and "FIFO" in str(error), error
    # a folder is read as save_pretrained writes one: here its only .safetensors is the FIFO
    error = without_hanging(lambda: _checkpoint_files(str(tmp_path)), fifos=[fifo])
    assert isinstance(error, ValueError) and fifo in str(error) and "FIFO" in str(error), error
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_refused(lambda: _checkpoint_files(str(empty)), r"expected one \*\.safetensors\.index\.json", empty)
    assert_refused(lambda: _read_header(str(tmp_path / "none.safetensors")), "no such file", tmp_path)


# ---------------------------------------------------------------- index JSON

@pytest.fixture
def folder(tmp_path):
    """tmp/ckpt/ with a valid shard a.safetensors, and tmp/outside.safetensors next to it."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"x": torch.zeros(2)}, str(ckpt / "a.safetensors"))
    save_file({"y": torch.zeros(2)}, str(tmp_path / "outside.safetensors"))
    return ckpt


def write_index(folder, weight_map, name="model.safetensors.index.json"):
    path = folder / name
    path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return str(path)


def test_index_shards_resolve_inside_the_folder(folder):
    os.symlink("a.safetensors", folder / "link.safetensors")  # a link that stays inside: fine
    index = write_index(folder, {"x": "a.safetensors", "x2": "./a.safetensors", "x3": "link.safetensors"})
    names = ["a.safetensors", "./a.safetensors", "link.safetensors"]
    assert _checkpoint_files(index) == sorted(os.path.join(folder, n) for n in names)


def test_hub_cache_layout_is_accepted(tmp_path):
    # The Hugging Face hub cache: snapshots/<rev>/* are links to ../../blobs/*, the
    # index included. A shard may resolve to the folder the index really lives in.
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snap.mkdir(parents=True)
    save_file({"x": torch.zeros(2)}, str(blobs / "1f3a"))
    (blobs / "9c0d").write_text(json.dumps({"weight_map": {"x": "model-00001.safetensors"}}))
    os.symlink("../../blobs/1f3a", snap / "model-00001.safetensors")
    os.symlink("../../blobs/9c0d", snap / "model.safetensors.index.json")
    assert _checkpoint_files(str(snap / "model.safetensors.index.json")) == [str(snap / "model-00001.safetensors")]


def test_index_shard_outside_the_folder_is_refused(folder, tmp_path):
    os.symlink("../outside.safetensors", folder / "escape.safetensors")
    cases = {
        "../outside.safetensors": "'..' component",
        "sub/../../outside.safetensors": "'..' component",
        str(tmp_path / "outside.safetensors"): "absolute path",
        "escape.safetensors": "outside the index's folder",
    }
    for shard, match in cases.items():
        index = write_index(folder, {"x": "a.safetensors", "y": shard})
        assert_refused(lambda: _checkpoint_files(index), match, index, repr(shard))


def test_index_shard_that_is_not_a_regular_file_is_refused(folder):
    os.mkfifo(folder / "fifo.safetensors")
    (folder / "dir.safetensors").mkdir()
    fifo_index = write_index(folder, {"x": "a.safetensors", "y": "fifo.safetensors"}, "fifo.index.json")
    error = without_hanging(_checkpoint_files, fifo_index, fifos=[str(folder / "fifo.safetensors")])
    assert isinstance(error, ValueError), error
    assert fifo_index in str(error) and "'fifo.safetensors'" in str(error) and "FIFO" in str(error), error
    for shard, match in {"dir.safetensors": "a directory", "gone.safetensors": "no such file"}.items():
        index = write_index(folder, {"x": "a.safetensors", "y": shard})
        assert_refused(lambda: _checkpoint_files(index), match, index, repr(shard))


@pytest.mark.parametrize("content,match", [
    ("[]", "needs a 'weight_map'"),
    ('{"metadata": {}}', "needs a 'weight_map'"),
    ('{"weight_map": ["a.safetensors"]}', "needs a 'weight_map'"),
    ('{"weight_map": {}}', "names no shard"),
    ('{"weight_map": {"x": 3}}', "not a shard file name"),
    ('{"weight_map": {"x": ""}}', "not a shard file name"),
    ('{"weight_map": {"x": "a.safe', "not valid JSON"),
])
def test_malformed_index_is_refused(folder, content, match):
    index = folder / "model.safetensors.index.json"
    index.write_text(content)
    assert_refused(lambda: _checkpoint_files(str(index)), match, index)


# ---------------------------------------------------------------- end to end

@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    sd = {k: v.contiguous() for k, v in TwoGroupModel().state_dict().items()}
    path = tmp_path / "model.safetensors"
    save_file(sd, str(path))
    return path


def rewrite(path, edit, extra=b""):
    """Rewrite the header of the safetensors file at `path` with `edit(header)`; `extra`
    is appended to the data."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    edit(header)
    write_raw(path, header, data + extra)


def set_field(key, field, value):
    return lambda h: h[key].__setitem__(field, value)


def same_bytes(h):
    h["transformer_blocks.1.up.weight"]["data_offsets"] = h["transformer_blocks.0.up.weight"]["data_offsets"]


@pytest.mark.parametrize("edit,extra,match,key", [
    (same_bytes, b"", "overlap|belong to no tensor", None),
    (None, b"\0" * 8, "8 trailing bytes", None),
    (set_field("head.weight", "dtype", "F33"), b"", "unknown dtype 'F33'", "head.weight"),
    (set_field("head.weight", "shape", [32, 31]), b"", "needs 3968", "head.weight"),
    (set_field("embed.bias", "data_offsets", [0, 2**64]), b"", "below 2\\*\\*64", "embed.bias"),
], ids=["same bytes", "trailing bytes", "unknown dtype", "nbytes", "offset 2**64"])
def test_load_offloaded_refuses_a_bad_header_and_leaves_the_model(saved, edit, extra, match, key):
    rewrite(saved, edit or (lambda h: None), extra)
    model = empty_model()
    assert_refused(lambda: layerwise.load_offloaded(model, saved, GROUPS, device="cpu"), match, saved,
                   *([repr(key)] if key else []))
    assert untouched(model)


def test_load_offloaded_refuses_a_bad_index_and_leaves_the_model(saved, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with safe_open(str(saved), "pt") as f:
        keys = list(f.keys())
    index = write_index(ckpt, {k: "../model.safetensors" for k in keys})
    model = empty_model()
    assert_refused(lambda: layerwise.load_offloaded(model, index, GROUPS, device="cpu"), "'..' component",
                   index, "'../model.safetensors'")
    assert untouched(model)

    os.mkfifo(ckpt / "fifo.safetensors")
    index = write_index(ckpt, {k: "fifo.safetensors" for k in keys})
    model = empty_model()
    error = without_hanging(lambda: layerwise.load_offloaded(model, index, GROUPS, device="cpu"),
                            fifos=[str(ckpt / "fifo.safetensors")])
    assert isinstance(error, ValueError) and index in str(error) and "'fifo.safetensors'" in str(error), error
    assert untouched(model)

    os.link(saved, ckpt / "model.safetensors")  # the same file, inside the folder: loads
    index = write_index(ckpt, {k: "model.safetensors" for k in keys})
    model = empty_model()
    layerwise.load_offloaded(model, index, GROUPS, device="cpu")
    assert not any(p.is_meta for p in model.parameters())
    layerwise.remove_layerwise_offload(model)

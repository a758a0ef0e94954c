"""The tests' fixture modules: what more than one test module (or a process a
test starts) uses. A test module imports them as `helpers.<module>`; it never
imports another test module (tests/test_layout.py checks both).

models.py        small models: two layer groups, mixed dtypes, non-contiguous and tied parameters
doors.py         the front doors side by side, and a checkpoint saved for them
disk.py          the disk tier's model, inputs, checkpoint and host budgets
contract.py      the state contract's fingerprints and "no trace of layerwise" check
residency.py     the residency tests' model, inputs and leaf equality
archs.py         tiny real architectures (diffusers, transformers) and how to run them
compress.py      stacks whose weights compress like trained ones (or not at all)
codec.py         the codec's inputs and checks, and the Triton decode kernel under test
quantized.py     torchao / optimum-quanto quantized stacks and bitwise state checks
bnb.py           bitsandbytes stacks (int8, nf4) and bitwise state checks
moe.py           tiny mixture-of-experts language models of transformers
tune.py          tune's test stack and a reading of its plan
ranks.py         ranks in subprocesses: free_port, run_ranks
devices.py       cuda_usable: a GPU and a CUDA build
fetch_timing.py  what the meter times, checked structurally
split_worker.py, cuda_path_worker.py, tp_worker.py   the ranks' scripts (run by path)
"""

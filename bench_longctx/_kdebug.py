import torch, itertools
from tests.engine_adapter.test_paged_attention import make_case
from engine_adapter.paged_attention import paged_decode
from engine_adapter.paged_attention_ref import paged_decode_ref
for lengths, hd, bt, frac in [([64, 32], 16, 16, 0.5), ([64, 32], 32, 16, 0.5), ([64, 32], 64, 16, 0.5), ([63, 31], 16, 16, 0.5), ([64, 32], 16, 16, 0.0), ([64, 32], 16, 16, 1.0), ([128, 64], 64, 32, 0.5), ([64,32],32,16,0.0)]:
    case = make_case(lengths, 2, 2, hd, bt, frac, seed=5)
    out, _ = paged_decode(*case.args(), return_block_mass=True)
    ref, _ = paged_decode_ref(*case.args(), return_block_mass=True)
    print(lengths, hd, bt, frac, float((out.float()-ref.float()).abs().max()))

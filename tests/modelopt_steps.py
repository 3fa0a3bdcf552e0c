"""A few steps of ModelOpt's offline DFlash training on CPU from a vx output (run by
tests/test_modelopt.py with ModelOpt's transformers first on PYTHONPATH): the model ModelOpt's
example main.py builds (`load_vlm_or_llm(..., use_offline_training=True)`, `mtsp.convert(model,
[("dflash", cfg)])`), vx's offline data module over ModelOpt's own dataset and collator, and the
step its Trainer takes, in fp32 (CPUs without bf16 units emulate bf16 ~80x slower; the batch is
cast as a GPU run's would be moved). Prints the draft's layers and each step's loss as JSON.

    python tests/modelopt_steps.py MODEL_DIR OUTPUT STEPS
"""

import json
import sys
from types import SimpleNamespace

import torch

from vx.train import modelopt as vx_modelopt

model_dir, output, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
vx_modelopt.install()
import modelopt.torch.speculative as mtsp  # noqa: E402  (after install: its convert records the draft's layers)
from modelopt.torch.speculative.utils import load_vlm_or_llm  # noqa: E402

model = load_vlm_or_llm(model_dir, use_offline_training=True, dtype=torch.float32, device_map="cpu")
mtsp.convert(model, [("dflash", {"dflash_offline": True, "dflash_block_size": 4, "dflash_num_anchors": 16,
                                 "dflash_mask_token_id": 0, "dflash_architecture_config": {"num_hidden_layers": 2}})])


def refused(*_, **__):
    raise AssertionError("a vx output must not reach the example's own file listing")


data = vx_modelopt._offline_module(refused)(None, SimpleNamespace(mode="offline", offline_data_path=output,
                                                                  sample_size=-1), train_len=128, answer_only_loss=True)
loader = torch.utils.data.DataLoader(data["train_dataset"], batch_size=2, shuffle=True, num_workers=2,
                                     collate_fn=data["data_collator"])


def fp32(d):
    return {k: fp32(v) if isinstance(v, dict) else v.float() if torch.is_tensor(v) and v.is_floating_point() else v
            for k, v in d.items()}


opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
model.train()
first = fp32(next(iter(loader)))
losses = []
for step in range(steps):  # the first batch again and again: a drafter that learns fits it
    loss = model(**first).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
print(json.dumps({"layers": list(model.target_layer_ids), "losses": losses,
                  "batches": sum(1 for _ in loader), "type": type(data["train_dataset"]).__name__}))

"""The defaults of the settings that a space file and a job both have: their one home.

The space file's schema (`plora.spec.schema`) says what a user may leave out; the job config
(`plora.job.config`) says what a job does when its file leaves a setting out (a probe's or a
benchmark's job, built without a space file). Both take these values from here, so that a
job built from a space file and one built by hand train alike. Imports nothing.
"""

from __future__ import annotations

# model
DTYPE = "float32"

# data
DATA_FORMAT = "auto"
INPUT_COLUMN = "input"
OUTPUT_COLUMN = "output"
INSTRUCTION_COLUMN = "instruction"
MESSAGES_COLUMN = "messages"
CONVERSATIONS_COLUMN = "conversations"
ON_BAD_ROWS = "error"
#: eval rows an adapter is scored on at most
MAX_EVAL_SAMPLES = 256

# lora
LORA_DROPOUT = 0.0

# training
SCHEDULER = "constant"
GRAD_CLIP = 1.0
WEIGHT_DECAY = 0.0
ACTIVATION_CHECKPOINTING = False
CUDA_GRAPHS = "auto"
ROW_LAYOUT = "auto"
LENGTH_BUCKETS = "auto"
CHECKPOINT_EVERY_STEPS = 500
CHECKPOINT_EVERY_MINUTES = 10.0

# eval
EVAL_METRICS: tuple[str, ...] = ("loss", "exact_match")
MAX_NEW_TOKENS = 16
INTERMEDIATE_SAMPLES = 32
#: rows an eval forward takes at once (a job's ``eval.batch_rows``; what the cost model prices an eval at)
EVAL_BATCH_ROWS = 256
#: the same on a GPU, where an eval forward's own cost is mostly fixed (launches, the host's
#: work: about 0.1 s for SmolLM2-135M on an H200 whether it holds 16k tokens or 190k), so few
#: large forwards beat many small ones; the device's free memory still caps each one's tokens
#: (`plora.results.evaluate.eval_token_budget`)
EVAL_BATCH_ROWS_GPU = 2048


def eval_batch_rows(configured: int | None, device_type: str) -> int:
    """Rows an eval forward takes at once: ``eval.batch_rows`` where set, else by device."""
    if configured is not None:
        return int(configured)
    return EVAL_BATCH_ROWS_GPU if device_type == "cuda" else EVAL_BATCH_ROWS

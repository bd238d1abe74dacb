"""Kimi-K2.x special tokens: the ids every loaded tokenizer is checked against.

K2, K2-Thinking, K2.5 and K2.6 share this layout (K3 does not). 163,584 BPE ranks are
followed by 256 reserved special ids, 163584..163839, so the vocabulary is 163,840.
The history's costliest constant bug (`<|im_end|>` assumed to be 163533, an ordinary BPE
token) is why nothing downstream hard-codes these ids: it asks the loaded tokenizer, and
the loader refuses a tokenizer whose ids differ from this table.
"""

from __future__ import annotations

NUM_BPE_RANKS = 163_584
NUM_RESERVED_SPECIAL = 256
VOCAB_SIZE = NUM_BPE_RANKS + NUM_RESERVED_SPECIAL  # 163,840

BOS = "[BOS]"
EOS = "[EOS]"
IM_END = "<|im_end|>"
IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_SYSTEM = "<|im_system|>"
IM_MIDDLE = "<|im_middle|>"
TOOL_CALLS_SECTION_BEGIN = "<|tool_calls_section_begin|>"
TOOL_CALLS_SECTION_END = "<|tool_calls_section_end|>"
TOOL_CALL_BEGIN = "<|tool_call_begin|>"
TOOL_CALL_ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
TOOL_CALL_END = "<|tool_call_end|>"
THINK = "<think>"
THINK_END = "</think>"
UNK = "[UNK]"
PAD = "[PAD]"

# Expected id of every named special token (../shared/reference/kimi-k25.md).
KIMI_SPECIAL_TOKENS: dict[str, int] = {
    BOS: 163584,
    EOS: 163585,
    IM_END: 163586,
    IM_USER: 163587,
    IM_ASSISTANT: 163588,
    "<|start_header_id|>": 163590,
    "<|end_header_id|>": 163591,
    "[EOT]": 163593,
    IM_SYSTEM: 163594,
    TOOL_CALLS_SECTION_BEGIN: 163595,
    TOOL_CALLS_SECTION_END: 163596,
    TOOL_CALL_BEGIN: 163597,
    TOOL_CALL_ARGUMENT_BEGIN: 163598,
    TOOL_CALL_END: 163599,
    IM_MIDDLE: 163601,
    "<|media_begin|>": 163602,
    "<|media_content|>": 163603,
    "<|media_end|>": 163604,
    "<|media_pad|>": 163605,
    THINK: 163606,
    THINK_END: 163607,
    UNK: 163838,
    PAD: 163839,
}

# Tokens whose ids the reconstruction relies on; a tokenizer missing any of them is refused.
# (Media tokens are named differently across revisions, so they are checked only when present.)
REQUIRED_SPECIAL_TOKENS = [t for t in KIMI_SPECIAL_TOKENS if not t.startswith("<|media")]

# Tool-call markers: generated as single special tokens even when they come back as raw text.
TOOL_CALL_MARKERS = [
    TOOL_CALLS_SECTION_BEGIN,
    TOOL_CALLS_SECTION_END,
    TOOL_CALL_BEGIN,
    TOOL_CALL_ARGUMENT_BEGIN,
    TOOL_CALL_END,
]


def reserved_token_name(token_id: int) -> str:
    """Name Kimi's tokenizer gives a reserved id that has no entry in added_tokens_decoder."""
    return f"<|reserved_token_{token_id}|>"

"""Parallel-thinking structure: block/path ids from character spans, Parallel-R1 position ids, malformed input."""
import random
import re

import numpy as np
import pytest

from data.shards.parallel_thinking import StructureError, parse_blocks, position_ids, token_structure, validate_structure
from tests.conftest import fixture_path, tokenizer_dir


def toy_offsets(text: str, pattern: str = r"</?|[A-Za-z]+|>\n?|\n|[^\S\n]+|.") -> np.ndarray:
    """A tiny tokenizer: '</' and '<' split from the tag name and '>' fused with a following newline (like Qwen)."""
    return np.array([m.span() for m in re.finditer(pattern, text, re.S)], dtype=np.int64)


def labelled(text, offsets, block_ids, path_ids):
    return [(text[s:e], int(b), int(p)) for (s, e), b, p in zip(offsets, block_ids, path_ids)]


def structure(text, pattern=None):
    offsets = toy_offsets(text) if pattern is None else toy_offsets(text, pattern)
    return offsets, *token_structure(text, offsets, [(0, len(text))])


# ------------------------------------------------------------------------------------------- token_structure
def test_one_block_ids_and_separator_rule():
    text = "Go.\n<Parallel>\n<Path>\nx y\n</Path>\n<Path>\nz\n</Path>\n</Parallel>\nok"
    offsets, block, path = structure(text)
    assert labelled(text, offsets, block, path) == [
        ("Go", 0, 0), (".", 0, 0), ("\n", 0, 0),
        ("<", 1, 0), ("Parallel", 1, 0), (">\n", 1, 0),  # the <Parallel> tag is shared by every path
        ("<", 1, 1), ("Path", 1, 1), (">\n", 1, 1), ("x", 1, 1), (" ", 1, 1), ("y", 1, 1), ("\n", 1, 1),
        ("</", 1, 1), ("Path", 1, 1), (">\n", 1, 1),  # '>\n' starts in </Path>: path 1 keeps the newline
        ("<", 1, 2), ("Path", 1, 2), (">\n", 1, 2), ("z", 1, 2), ("\n", 1, 2), ("</", 1, 2), ("Path", 1, 2),
        (">\n", 1, 2),
        ("</", 1, 0), ("Parallel", 1, 0), (">\n", 1, 0),  # </Parallel> sees all paths
        ("ok", 0, 0),
    ]


def test_text_between_paths_belongs_to_the_following_path():
    text = "<Parallel> <Path>a</Path> or <Path>b</Path> end </Parallel>"
    offsets = np.array([(i, i + 1) for i in range(len(text))])  # one token per character
    block, path = token_structure(text, offsets, [(0, len(text))])
    owner = {}
    for ch_index, (b, p) in enumerate(zip(block, path)):
        owner.setdefault((int(b), int(p)), []).append(text[ch_index])
    assert "".join(owner[(1, 1)]) == " <Path>a</Path>"
    assert "".join(owner[(1, 2)]) == " or <Path>b</Path>"  # separator text goes with the path that follows
    assert "".join(owner[(1, 0)]) == "<Parallel> end </Parallel>"


def test_token_straddling_a_boundary_belongs_to_the_region_of_its_first_character():
    text = "<Parallel><Path>a</Path><Path>b</Path></Parallel>"
    # '><' and '></' are single tokens, as Qwen's pre-tokenizer makes them for adjacent tags
    offsets, block, path = structure(text, r"></?|</?|[A-Za-z]+|>")
    assert labelled(text, offsets, block, path) == [
        ("<", 1, 0), ("Parallel", 1, 0), ("><", 1, 0),
        ("Path", 1, 1), (">", 1, 1), ("a", 1, 1), ("</", 1, 1), ("Path", 1, 1), ("><", 1, 1),
        ("Path", 1, 2), (">", 1, 2), ("b", 1, 2), ("</", 1, 2), ("Path", 1, 2), ("></", 1, 2),
        ("Parallel", 1, 0), (">", 1, 0),
    ]


def test_a_token_carrying_path_content_across_a_tag_is_rejected():
    text = "<Parallel><Path>a</Path><Path>bc</Path></Parallel>"
    second = text.index("<Path>bc")

    def merged(first, last):  # one token per character, except chars first..last-1 in one token
        return np.array([(i, i + 1) for i in range(first)] + [(first, last)]
                        + [(i, i + 1) for i in range(last, len(text))])

    block, path = token_structure(text, merged(second, second + 7), [(0, len(text))])  # '<Path>b': in path 2
    assert (block[second], path[second]) == (1, 2)
    with pytest.raises(StructureError, match="merges text across the <Path> tag of path 2 of block 1"):
        token_structure(text, merged(second - 1, second + 7), [(0, len(text))])  # '><Path>b' starts in path 1


def test_tags_outside_the_spans_are_ignored_and_blocks_count_over_spans():
    block_text = "<Parallel><Path>a</Path><Path>b</Path></Parallel>"
    text = "user asks about <Parallel> and <Path>|" + block_text + "|user again </Path>|" + block_text
    first = text.index("|") + 1
    spans = [(first, first + len(block_text)), (len(text) - len(block_text), len(text))]
    offsets = toy_offsets(text)
    block, path = token_structure(text, offsets, spans)
    assert sorted(set(block.tolist())) == [0, 1, 2]
    assert block[: np.searchsorted(offsets[:, 0], first)].max() == 0  # the prompt's tags are plain text
    assert position_ids(block, path).shape == (len(offsets),)


MALFORMED = [
    ("<Parallel><Path>a</Path><Path>b", "unclosed <Path>"),
    ("<Parallel><Path>a</Path><Path>b</Path>", "unclosed <Parallel>"),
    ("<Parallel><Path>a</Path><Parallel>", "nested <Parallel> inside the <Parallel>"),
    ("<Parallel><Path>a<Parallel>", "nested <Parallel> inside the <Path>"),
    ("<Parallel><Path>a<Path>", "nested <Path>"),
    ("<Path>a</Path>", "<Path> outside a <Parallel> block"),
    ("x</Path>", "</Path> outside a <Parallel> block"),
    ("<Parallel>a</Path>", "</Path> without an open <Path>"),
    ("<Parallel><Path>a</Path></Parallel>", "has 1 path(s), needs at least 2"),
    ("<Parallel>just text</Parallel>", "has 0 path(s), needs at least 2"),
    ("a</Parallel>", "</Parallel> without an open <Parallel>"),
    ("<Parallel><Path>a</Parallel>", "</Parallel> while the <Path> opened at assistant char 10 is unclosed"),
    ("<Summary>s", "unclosed <Summary>"),
    ("<Summary><Summary>", "nested <Summary>"),
    ("</Summary>", "</Summary> without an open <Summary>"),
    ("<Parallel><Summary>", "<Summary> inside the <Parallel> opened at assistant char 0"),
    ("<Summary><Parallel>", "<Parallel> inside the <Summary>"),
]


@pytest.mark.parametrize("body,message", MALFORMED)
def test_malformed_structure_raises_a_clear_error(body, message):
    text = "prompt <Path> " + body  # the prompt's stray tag is outside the span and must not matter
    span = (len("prompt <Path> "), len(text))
    with pytest.raises(StructureError, match=re.escape(message)) as info:
        token_structure(text, toy_offsets(text), [span])
    assert "assistant char" in str(info.value)


def test_random_tag_soup_never_raises_anything_but_structure_error():
    rng = random.Random(0)
    pieces = ["<Parallel>", "</Parallel>", "<Path>", "</Path>", "<Summary>", "</Summary>", "\n", "ab", " ", "><"]
    parsed = 0
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        if rng.random() < 0.5:  # random token boundaries
            cuts = sorted(set(rng.sample(range(1, len(text) + 1), min(len(text), rng.randint(0, 12))) + [len(text)]))
            offsets = np.array(list(zip([0] + cuts[:-1], cuts)), dtype=np.int64).reshape(-1, 2)
        else:
            offsets = toy_offsets(text).reshape(-1, 2)
        try:
            block, path = token_structure(text, offsets, [(0, len(text))])
        except StructureError:
            continue
        parsed += 1
        validate_structure(block, path)
        assert len(position_ids(block, path)) == len(offsets)
    assert parsed > 0


def test_parse_blocks_gives_character_spans():
    text = "<Parallel>\n<Path>A</Path>\n<Path>BB</Path>\n</Parallel>"
    (block,) = parse_blocks(text)
    assert (block.start, block.open_end, block.end) == (0, 10, len(text))
    assert [text[p.content_start:p.content_end] for p in block.paths] == ["A", "BB"]
    assert [text[p.region_start:p.region_end] for p in block.paths] == ["\n<Path>A</Path>", "\n<Path>BB</Path>"]


# ------------------------------------------------------------------------------------------- position_ids
def ids(*segments):
    """segments of (count, block, path) -> (block_ids, path_ids)."""
    block = np.concatenate([np.full(n, b, np.int16) for n, b, _ in segments])
    path = np.concatenate([np.full(n, p, np.int16) for n, _, p in segments])
    return block, path


def test_positions_without_blocks_count_up():
    assert position_ids(np.zeros(5, np.int16), np.zeros(5, np.int16)).tolist() == [0, 1, 2, 3, 4]


def test_positions_match_parallel_r1_with_single_token_tags():
    # x <Parallel> [<Path> a </Path>] [<Path> b c </Path>] </Parallel> y
    block, path = ids((1, 0, 0), (1, 1, 0), (3, 1, 1), (4, 1, 2), (1, 1, 0), (1, 0, 0))
    # Parallel-R1: <Parallel> at B=1, every <Path> at B+1, </Parallel> at B + longest(4) + 1, then counting on
    assert position_ids(block, path).tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 7]


def test_positions_one_block_unequal_paths_longest_first():
    block, path = ids((3, 0, 0), (1, 1, 0), (4, 1, 1), (2, 1, 2), (2, 1, 0), (2, 0, 0))
    assert position_ids(block, path).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 8, 9, 10, 11]


def test_positions_two_blocks_three_paths():
    block, path = ids((2, 0, 0), (2, 1, 0), (2, 1, 1), (3, 1, 2), (1, 1, 3), (1, 1, 0),
                      (1, 0, 0), (1, 2, 0), (1, 2, 1), (2, 2, 2), (1, 2, 0))
    expected = [0, 1, 2, 3,  # prefix and the 2-token <Parallel> tag: B = 3
                4, 5, 4, 5, 6, 4,  # paths of 2, 3, 1 tokens all start at B + 1
                7, 8,  # B + 3 + 1, then counting on
                9, 10, 10, 11, 12]  # block 2: 1-token tag at B = 9; paths of 1, 2 tokens; after: 9 + 2 + 1
    assert position_ids(block, path).tolist() == expected


def test_positions_block_at_the_start_and_end_of_the_sequence():
    block, path = ids((2, 1, 1), (3, 1, 2))
    assert position_ids(block, path).tolist() == [0, 1, 0, 1, 2]


@pytest.mark.parametrize("segments,message", [
    (((2, 0, 0), (1, 1, 0), (3, 1, 1), (1, 1, 0)), "single path"),
    (((1, 1, 0), (2, 1, 2), (2, 1, 1)), "path 2 at token 1 where path 1 was expected"),
    (((1, 1, 1), (1, 1, 2), (1, 1, 1)), "path 1 at token 2 where path 3 was expected"),
    (((2, 0, 1),), "has a path id but no block id"),
    (((1, 1, 1), (1, 1, 0), (1, 1, 2)), "outside every path between its paths"),
    (((1, 1, 1), (1, 1, 2), (1, 0, 0), (1, 2, 1), (1, 2, 2), (1, 0, 0), (1, 1, 1), (1, 1, 2)), "not contiguous"),
    (((1, 1, 1), (1, 1, 2), (1, 2, 1), (1, 2, 2)), "right after the last path of block 1"),
])
def test_positions_reject_invalid_ids(segments, message):
    with pytest.raises(StructureError, match=re.escape(message)):
        position_ids(*ids(*segments))


def test_unclosed_path_in_text_is_an_error_before_positions():
    text = "<Parallel><Path>a</Path><Path>b</Parallel>"
    with pytest.raises(StructureError, match="unclosed <Path>|while the <Path>"):
        token_structure(text, toy_offsets(text), [(0, len(text))])


# ------------------------------------------------------------------------------------------- the real fixture
def test_parallel_r1_fixture_with_qwen_tokenizer():
    pq = pytest.importorskip("pyarrow.parquet")
    from transformers import AutoTokenizer

    rows = pq.read_table(fixture_path("data", "parallel_r1_gsm8k_sft_train.parquet"),
                         columns=["prompt", "output"]).to_pylist()
    tok = AutoTokenizer.from_pretrained(tokenizer_dir("qwen2_5_instruct"))
    texts, spans = [], []
    for row in rows:
        messages = [dict(m) for m in row["prompt"]] + [{"role": "assistant", "content": row["output"]}]
        text = tok.apply_chat_template(messages, tokenize=False)
        start = text.rindex(row["output"])
        texts.append(text)
        spans.append((start, start + len(row["output"])))
    encoded = tok(texts, return_offsets_mapping=True, add_special_tokens=False)
    assert len(rows) == 341
    parsed, errors = 0, []
    for text, span, row, input_ids, offsets in zip(texts, spans, rows, encoded["input_ids"],
                                                   encoded["offset_mapping"]):
        try:
            block, path = token_structure(text, np.array(offsets), [span])
        except StructureError as exc:
            errors.append(str(exc))
            continue
        parsed += 1
        input_ids = np.array(input_ids)
        # an independent reading of the tags: regular expressions over the raw output
        expected_blocks = re.findall(r"<Parallel>(.*?)</Parallel>", row["output"], re.S)
        assert block.max() == len(expected_blocks)
        for b, inner in enumerate(expected_blocks, start=1):
            whole = tok.decode(input_ids[block == b]).strip()
            assert whole == "<Parallel>" + inner + "</Parallel>"
            # [text before path 1, path 1, text before path 2, path 2, ..., text after the last path]
            pieces = re.split(r"<Path>(.*?)</Path>", inner, flags=re.S)
            separators, contents, tail = pieces[0:-1:2], pieces[1::2], pieces[-1]
            assert path[block == b].max() == len(contents) >= 2
            for p, (separator, content) in enumerate(zip(separators, contents), start=1):
                decoded = tok.decode(input_ids[(block == b) & (path == p)])
                # exact, up to whitespace at the ends that a fused '>\n' token moves across the boundary
                assert decoded.strip() == (separator + "<Path>" + content + "</Path>").strip()
            shared = tok.decode(input_ids[(block == b) & (path == 0)])
            assert re.sub(r"\s", "", shared) == re.sub(r"\s", "", "<Parallel>" + tail + "</Parallel>")
        outside = tok.decode(input_ids[block == 0])
        assert "<Path>" not in outside[outside.rindex("<|im_start|>assistant"):]
        positions = position_ids(block, path)
        for b in range(1, block.max() + 1):
            path_starts = {int(positions[(block == b) & (path == p)][0]) for p in range(1, path[block == b].max() + 1)}
            assert len(path_starts) == 1  # every path of a block starts at the same position
        assert positions.max() < len(positions)
    assert parsed == 340
    assert len(errors) == 1 and "unclosed <Summary>" in errors[0] and "assistant char" in errors[0]

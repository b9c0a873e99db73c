"""The verifiable reward of the verl end-to-end run, as verl's ``custom_reward_function`` file.

Share of the words "a" and "b" in the response (the TRL tests' ``RecordingReward`` rule).
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    words = solution_str.split()
    return sum(w in ("a", "b") for w in words) / max(len(words), 1)

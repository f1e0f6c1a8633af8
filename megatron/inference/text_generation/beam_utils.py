"""Finished hypotheses of beam search (`BeamHypotheses`), scored with a length penalty."""


class BeamHypotheses:
    """The best `num_beams` finished hypotheses, each scored sum_logprobs / length**length_penalty.

    Args:
        num_beams (int): hypotheses kept.
        length_penalty (float): exponent of the length normalisation (> 1 favours longer ones).
        early_stopping (bool): stop as soon as num_beams hypotheses are finished.
    """

    def __init__(self, num_beams, length_penalty=1.0, early_stopping=False):
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.num_beams = num_beams
        self.beams = []
        self.worst_score = 1e9

    def __len__(self):
        """Number of hypotheses in the list."""
        return len(self.beams)

    def add(self, hyp, sum_logprobs, length):
        """Add a hypothesis (token row, summed log probs, generated length) if it is among the
        best num_beams; the worst one is dropped on overflow."""
        score = sum_logprobs / length**self.length_penalty
        if len(self) < self.num_beams or score > self.worst_score:
            self.beams.append((score, hyp))
            if len(self) > self.num_beams:
                sorted_scores = sorted([(s, idx) for idx, (s, _) in enumerate(self.beams)])
                del self.beams[sorted_scores[0][1]]
                self.worst_score = sorted_scores[1][0]
            else:
                self.worst_score = min(score, self.worst_score)

    def is_done(self, best_sum_logprobs, cur_len):
        """Whether no open beam can beat the worst kept hypothesis: the list is full and its
        worst score is at least best_sum_logprobs / cur_len**length_penalty."""
        if len(self) < self.num_beams:
            return False
        if self.early_stopping:
            return True
        cur_score = best_sum_logprobs / cur_len**self.length_penalty
        return self.worst_score >= cur_score

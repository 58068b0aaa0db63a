"""SpecAugment (Park et al. 2019): frequency and time masks on a training batch's features, set to 0 (the mean of
the per-utterance normalised features)."""
import logging
import zlib

import torch
import torchaudio

from batchrnn.config import ConfigError

log = logging.getLogger(__name__)


class SpecAugment:
    """train.spec_augment's masks. per_utterance: each utterance's masks come from its own generator, seeded by
    (seed, epoch, utterance id), and lie within its own length, so they do not depend on which batch it is in,
    on the batch's padding, or on how many processes train. Otherwise torchaudio's masks, drawn from the
    process's random stream over the padded batch, as the earlier studies had them."""

    def __init__(self, cfg, seed: int):
        self.cfg, self.seed = cfg, seed
        masks = [torchaudio.transforms.FrequencyMasking(cfg.freq_width, iid_masks=True)] * cfg.freq_masks
        masks += [torchaudio.transforms.TimeMasking(cfg.time_width, iid_masks=True)] * cfg.time_masks
        self.batch_masks = torch.nn.Sequential(*masks)

    @property
    def active(self) -> bool:
        return self.cfg.enabled and self.cfg.freq_masks + self.cfg.time_masks > 0

    def check(self, lengths: list[int]) -> None:
        """Time masks against the training utterances' lengths (frames), which the configuration cannot know. Their
        masks together reach up to time_masks x time_width frames: refused where that is a typical (the median)
        utterance's length, so that no setting trains much of the corpus on zeros; a warning where it is only the
        shortest's. Capping each mask at a share of its utterance instead would change what existing settings train."""
        c = self.cfg
        reach, ordered = c.time_masks * c.time_width, sorted(lengths)
        if not reach or not ordered:
            return
        median = ordered[len(ordered) // 2]
        if reach >= median:
            raise ConfigError(f"train.spec_augment.time_width={c.time_width}: {c.time_masks} masks of up to "
                              f"{c.time_width} frames could cover the median training utterance ({median} frames) "
                              f"whole, and train on zeros; give time_masks x time_width less than {median}")
        if short := sum(n <= reach for n in ordered):
            log.warning("train.spec_augment: %d time masks of up to %d frames could cover the %d shortest of %d "
                        "training utterances (%d frames or fewer) whole", c.time_masks, c.time_width, short,
                        len(ordered), reach)

    def __call__(self, x: torch.Tensor, x_lens: torch.Tensor, ids: list[str], epoch: int) -> torch.Tensor:
        """x (N, F, T) padded features, x_lens (N,), ids the utterances' ids -> x masked (a new tensor)."""
        if not self.cfg.per_utterance:
            return self.batch_masks(x.unsqueeze(1)).squeeze(1)  # (N, 1, F, T): a mask per utterance
        x = x.clone()
        c, bins = self.cfg, x.shape[1]
        for k, (uid, length) in enumerate(zip(ids, x_lens.tolist())):
            g = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}/{epoch}/{uid}".encode()))
            u = iter(torch.rand(2 * (c.freq_masks + c.time_masks), generator=g, dtype=torch.float64).tolist())
            for _ in range(c.freq_masks):  # as torchaudio draws one: width U[0, W), start U[0, size - width)
                width = next(u) * min(c.freq_width, bins)
                start = next(u) * (bins - width)
                x[k, int(start):int(start + width), :length] = 0
            for _ in range(c.time_masks):
                width = next(u) * min(c.time_width, length)
                start = next(u) * (length - width)
                x[k, :, int(start):int(start + width)] = 0
        return x

"""bn=rbn: Cooijmans et al.'s recurrent BN, statistics per time step; a step loop."""
import torch

from batchrnn.config import ModelConfig, RNNType
from batchrnn.layers.base import cell_loop, full_precision
from batchrnn.layers.folds import track_moments
from batchrnn.layers.layernorm import FullLayerNormLayer


def step_moments(z: torch.Tensor, mask: torch.Tensor):
    """Mean and biased variance of z (S, N, F) over each step's valid rows (mask (S, N, 1)), each (S, F),
    and the count (S, 1); in float32 under autocast. A step with no valid row gets 0 and 0."""
    z, mask = full_precision(z), full_precision(mask)
    count = mask.sum(1)
    safe = count.clamp_min(1)
    mean = (z * mask).sum(1) / safe
    return mean, ((z - mean[:, None]).square() * mask).sum(1) / safe, count


class RecurrentBNLayer(FullLayerNormLayer):
    """bn=rbn: Cooijmans et al.'s (2016) recurrent batch normalisation, a step loop: ln_full's structure
    with a BN in place of each LN, its statistics per time step. LSTM (their eq. 6-8): (i, f, g, o) =
    BN_t(W x_t) + BN_t(U h_{t-1}), c_t = s(f) c_{t-1} + s(i) tanh(g), h_t = s(o) tanh(BN_t(c_t)); GRU and rnn
    as ln_full's. In training, BN_t takes the moments of step t over the batch's sequences still running
    at t (for the backward direction, its own t-th step) while at least MIN_ROWS run, and the later steps
    those of the last such step; in eval, the population moments of step t, averaged as BatchNorm's running
    ones, steps beyond the longest trained one (`trained_steps`, per direction: their T_max) taking its.
    The gains start at 0.1 and the shifts at 0, as theirs; parameters under ln_full's names, the moments
    in buffers running_{mean,var}_{ih,hh,cell} of (directions, MAX_STEPS, features).
    """

    MAX_STEPS = 512  # frames after the front end: AN4's longest utterance is under this at time stride 2
    MIN_ROWS = 2  # a variance needs two sequences; one alone would normalise to the shift exactly
    GAIN, MOMENTUM, EPS = 0.1, 0.1, 1e-5

    def __init__(self, cfg: ModelConfig, input_size: int):
        super().__init__(cfg, input_size)
        norms = {"ih": self.width, "hh": self.width} | ({"cell": self.hidden_size} if self.rnn is RNNType.lstm else {})
        with torch.no_grad():
            for name in norms:
                getattr(self, f"gain_{name}").fill_(self.GAIN)
                getattr(self, f"bias_{name}").zero_()
        for name, width in norms.items():
            self.register_buffer(f"running_mean_{name}", torch.zeros(self.directions, self.MAX_STEPS, width))
            self.register_buffer(f"running_var_{name}", torch.ones(self.directions, self.MAX_STEPS, width))
        # per direction, how many steps have had batch moments so far: their T_max
        self.register_buffer("trained_steps", torch.zeros(self.directions, dtype=torch.long))

    def population(self, name: str, d: int, steps) -> tuple[torch.Tensor, torch.Tensor]:
        """The population mean and variance of direction d at steps (an int or a tensor of them), detached."""
        last = max(min(int(self.trained_steps[d]), self.MAX_STEPS) - 1, 0)
        slots = steps.clamp_max(last) if torch.is_tensor(steps) else min(steps, last)
        return (getattr(self, f"running_mean_{name}")[d, slots].detach().clone(),
                getattr(self, f"running_var_{name}")[d, slots].detach().clone())

    def remember(self, name: str, d: int, mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor) -> None:
        """The population moments of steps 0..S-1 (those below MAX_STEPS with MIN_ROWS running) take a step
        of MOMENTUM towards the batch's (mean, var (S, F), count (S, 1)), as BatchNorm's running ones."""
        n = min(mean.shape[0], self.MAX_STEPS)
        means, variances = getattr(self, f"running_mean_{name}")[d, :n], getattr(self, f"running_var_{name}")[d, :n]
        count = count[:n].to(means.dtype)
        track_moments(means, variances, mean[:n], var[:n], count, self.MOMENTUM, keep=count >= self.MIN_ROWS)

    def normalise(self, v: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, gain, bias) -> torch.Tensor:
        scale = gain * torch.rsqrt(var + self.EPS)
        return torch.addcmul(bias - mean * scale, full_precision(v), scale)

    def input_preactivations(self, x, mask):  # W x as it comes: its BN_t is per step of each direction
        return [x @ self.weight_ih[k].t() for k in self.copy_of]

    def recurrence(self, z, d, mask):
        k, w_hh, lstm = self.copy_of[d], self.weight_hh[d], self.rnn is RNNType.lstm
        steps = torch.arange(z.shape[0], device=z.device)
        mean, var = self.population("ih", d, steps)
        if not self.training:
            z = self.normalise(z, mean[:, None], var[:, None], self.gain_ih[k], self.bias_ih[k])
            return cell_loop(self.rnn, z, lambda h, t: self.normalise(h @ w_hh.t(), *self.population("hh", d, t),
                                                                      self.gain_hh[d], self.bias_hh[d]),
                             (lambda c, t: self.normalise(c, *self.population("cell", d, t), self.gain_cell[d],
                                                          self.bias_cell[d])) if lstm else None)
        valid = mask[:, :, 0] > 0
        running = valid.sum(1).tolist()  # sequences running at each step, never more at a later step
        enough = sum(r >= self.MIN_ROWS for r in running)  # the steps with batch moments: a prefix
        batch_mean, batch_var, count = step_moments(z, mask)
        if enough:  # the later steps take the last such step's moments (a batch of one: the population's)
            mean, var = batch_mean[steps.clamp_max(enough - 1)], batch_var[steps.clamp_max(enough - 1)]
        z = self.normalise(z, mean[:, None], var[:, None], self.gain_ih[k], self.bias_ih[k])
        # The rows longest first, so that the sequences still running at step t are the first running[t]:
        # each step's moments are one var_mean over a slice.
        order = torch.argsort(valid.sum(0), descending=True, stable=True)
        seen = {"hh": [], "cell": []}
        last = {}

        def step(name, v, t, gain, bias):  # BN_t of v (N, F), the rows in `order`
            if t < enough:
                var, mean = torch.var_mean(full_precision(v[: running[t]]), dim=0, correction=0)
                seen[name].append((mean.detach(), var.detach()))
                last[name] = mean, var
            return self.normalise(v, *last.get(name) or self.population(name, d, t), gain, bias)

        out = cell_loop(self.rnn, z[:, order],
                        lambda h, t: step("hh", h @ w_hh.t(), t, self.gain_hh[d], self.bias_hh[d]),
                        (lambda c, t: step("cell", c, t, self.gain_cell[d], self.bias_cell[d])) if lstm else None)
        self.remember("ih", d, batch_mean.detach(), batch_var.detach(), count)
        for name, moments in seen.items():  # the steps with MIN_ROWS running: a prefix, as running falls with t
            if moments:
                self.remember(name, d, *(torch.stack(m) for m in zip(*moments)),
                              torch.tensor(running[: len(moments)], device=z.device)[:, None])
        with torch.no_grad():
            self.trained_steps[d].clamp_(min=min(enough, self.MAX_STEPS))
        return out[:, torch.argsort(order)]

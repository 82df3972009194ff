"""The dense gated MLP: down(act(gate(x)) * up(x)), gate and up merged in one weight.
"""

from torch import nn

from mtpkit.kernels import elementwise
from mtpkit.parallel import TP
from mtpkit.shapes import Float, Tensor, checked
from mtpkit.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    """Gated MLP (dense layers): down(act(gate(x)) * up(x)), gate and up projections merged.
    SwiGLU (act "silu"); a family with another gate activation overrides `act` (a name of
    elementwise.ACTIVATIONS). act(g) * u is the backend's (`ops`) fused op."""

    act = "silu"

    def __init__(self, hidden: int, intermediate: int, tp: TP, ops=None):
        super().__init__()
        self.ops = ops
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [("gate_proj", intermediate, 1, False), ("up_proj", intermediate, 1, False)], tp)
        self.down_proj = RowParallelLinear(intermediate, hidden, tp)

    @checked
    def forward(self, x: Float[Tensor, "num_tokens hidden"]) -> Float[Tensor, "num_tokens hidden"]:
        g, u = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj((self.ops or elementwise).act_mul(g, u, self.act))

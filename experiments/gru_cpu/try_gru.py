"""Issue 26 prototype: build experiments/gru_cpu/gru.cpp (a C++ time loop for one GRU direction), check it
against nn.GRU in float64, then time nn.LSTM, nn.GRU and it interleaved at the an4_cpu layer shape (input 512,
H 256, batch 16, 67 frames, forward and backward). Run from the repository root: .venv/bin/pip install ninja, then
T=2 .venv/bin/python experiments/gru_cpu/try_gru.py. Not wired into the package: see experiments/cpu_gru.md."""
import torch, time, sys
from torch.utils.cpp_extension import load
t0=time.time()
ext = load("batchrnn_gru_cpu", ["experiments/gru_cpu/gru.cpp"], extra_cflags=["-O3", "-fopenmp-simd", *sys.argv[1:]], verbose=False)
print("build s", time.time()-t0)
class G(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_ih, b_ih, w_hh, b_hh):
        out, ws = ext.forward(x, w_ih, b_ih, w_hh, b_hh)
        ctx.save_for_backward(x, w_ih, w_hh, out, ws)
        return out
    @staticmethod
    def backward(ctx, g):
        return tuple(ext.backward(g, *ctx.saved_tensors))
torch.manual_seed(0)
gru=torch.nn.GRU(7,5).double()
x=torch.randn(6,3,7,dtype=torch.double,requires_grad=True)
ref=gru(x)[0]; g=torch.randn_like(ref)
ps=[x,gru.weight_ih_l0,gru.bias_ih_l0,gru.weight_hh_l0,gru.bias_hh_l0]
gr=torch.autograd.grad(ref,ps,g)
o=G.apply(*ps); go=torch.autograd.grad(o,ps,g)
print("out", (o-ref).abs().max().item(), "grads", max((a-b).abs().max().item() for a,b in zip(go,gr)))
torch.set_num_threads(int(__import__('os').environ.get("T","2")))
lstm=torch.nn.LSTM(512,256); gru=torch.nn.GRU(512,256)
xx=torch.randn(67,16,512,requires_grad=True)
ps=[xx,gru.weight_ih_l0,gru.bias_ih_l0,gru.weight_hh_l0,gru.bias_hh_l0]
f={"lstm":lambda: lstm(xx)[0].sum().backward(),"gru":lambda: gru(xx)[0].sum().backward(),"ext":lambda: G.apply(*ps).sum().backward()}
res={k:[] for k in f}
for r in range(8):
  for k,fn in f.items():
    fn(); t=time.perf_counter(); fn(); fn(); res[k].append((time.perf_counter()-t)/2*1e3)
import statistics
m={k:statistics.median(v) for k,v in res.items()}
print(m, "ext/lstm", m["ext"]/m["lstm"], "gru/lstm", m["gru"]/m["lstm"])

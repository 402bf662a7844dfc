import torch, warpforge as wf, sys
torch.manual_seed(0)
B,S,R,H,D=1,64,256,4,32
for std in (10, 40, 100, 300, 1000):
  bad=0
  for trial in range(3):
    q,k,v,g=(torch.randn(B,S,R,H,D,device="cuda",dtype=torch.bfloat16).requires_grad_() for _ in range(4))
    mask=torch.zeros(B,S,1,1,R,device="cuda"); mask[:,S//2:]=-1e9
    pair=(torch.randn(B,1,H,R,R,device="cuda")*std).to(torch.bfloat16).requires_grad_()
    out=wf.evoformer_attention(q,k,v,[mask,pair],gate=g,backend="triton")
    gr=torch.autograd.grad(out,(q,k,v,g,pair),torch.randn_like(out))
    bad+=sum(int(not torch.isfinite(t).all()) for t in gr)
  print(sys.argv[1], "std",std,"nonfinite grads",bad, flush=True)

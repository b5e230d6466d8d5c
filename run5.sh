source bench/gpu_env.sh
O=$OUT
timeout 150 python3 bench/decode.py --models qwen3-4b --batches 1,2,8,16,32,64,128,256 --hf-batches "" --steps 64 --kernels "all;all|cublas" --out $O/d4b > $O/d4b.log 2>&1; echo "d4b rc $?"
timeout 170 python3 bench/decode.py --models qwen3-8b --batches 1,2,8,16,32,64,128 --hf-batches "" --steps 64 --kernels "all;all|cublas" --out $O/d8b > $O/d8b.log 2>&1; echo "d8b rc $?"
timeout 110 python3 bench/engine_decode.py --model qwen3-4b --batches 32,128 --output-len 64 --modes ahead > $O/e_auto.log 2>&1; echo "e_auto rc $?"
OPENINFER_GEMM=cublas timeout 100 python3 bench/engine_decode.py --model qwen3-4b --batches 32,128 --output-len 64 --modes ahead > $O/e_cublas.log 2>&1; echo "e_cublas rc $?"
grep "^| qwen" $O/d4b.log $O/d8b.log | grep -v "op |" | cut -c1-150
grep -h "linear layers" $O/*.log | sort | uniq -c
tail -6 $O/e_auto.log $O/e_cublas.log

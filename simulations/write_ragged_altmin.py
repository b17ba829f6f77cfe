"""Write a ragged long-format AltMin example: one row per sample, users with 6 to 199 samples.

    python simulations/write_ragged_altmin.py ragged.parquet [USERS]

Columns: ``user`` (a string id), ``y`` (label), ``f0..f9`` (features); y = ⟨x, U*v_j⟩ + N(0, 0.1²)
with a rank-2 U* in 10 dimensions. A .csv name writes CSV instead.
"""

import sys

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

out = sys.argv[1]
n, d, k = (int(sys.argv[2]) if len(sys.argv) > 2 else 3000), 10, 2
rng = np.random.default_rng(0)
u_star = np.linalg.qr(rng.normal(size=(d, k)))[0]
counts = rng.integers(6, 200, size=n)
users = np.repeat([f"u{j:05d}" for j in range(n)], counts)
x = rng.normal(size=(counts.sum(), d))
v = np.repeat(rng.normal(size=(n, k)), counts, axis=0)
y = np.einsum("id,dk,ik->i", x, u_star, v) + 0.1 * rng.normal(size=len(x))
table = pa.table({"user": users, "y": y, **{f"f{i}": x[:, i] for i in range(d)}})
if out.endswith(".csv"):
    pacsv.write_csv(table, out)
else:
    pq.write_table(table, out)
print(f"{out}: {table.num_rows} rows, {n} users, {d} features")

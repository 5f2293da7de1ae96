"""Data-parallel attention: each rank attends over its own requests; the MLP runs
tensor-parallel over the tokens gathered from every rank. ``group``: the process groups;
``collectives``: gather and reduce-scatter of token rows; ``shard``: the MLP's weight shards;
``agreement``: what every rank agrees on before a step; ``controller``: which rank serves a
request; ``dp_engine``: one rank's serving loop; ``launch``: spawning the ranks."""

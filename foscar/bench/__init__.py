"""``foscar bench``'s library: the kernel grid beside FlashInfer (:mod:`foscar.bench.grid`), the
end-to-end decode benchmark (:mod:`foscar.bench.e2e`), their timing (:mod:`foscar.bench.timing`)
and the baselines' launchers (:mod:`foscar.bench.baselines`)."""

"""Synthetic card-transaction streams, as short token sequences for a fraud model.

A population of cards is simulated over a time window. Every card has a profile (home
country, typical amount, activity rate and hours, share of online purchases, regular
merchants, a device); legitimate transactions follow that profile, with the messy parts of
real traffic: trips abroad, short flights (a country change within two hours), VPNs, a
new phone, shopping sprees, in-game micro-purchase bursts, app-store charges of a dollar,
night-shift workers, big one-off purchases. Fraud episodes are injected into some cards'
histories; each pattern is a noisy distribution over the same fields, not a rule, so
patterns overlap legitimate traffic and no classifier reaches 100 %.

Fields of one transaction (one token each, in this order), then the query token `LABEL`,
whose next token is `OK` or `FRAUD`:

    ch_*    channel: pos, contactless, online, atm
    amt_k   amount band k = 0..9 (edges $2, 10, 25, 50, 100, 250, 500, 1000, 2500)
    mcc_*   merchant category (15)
    cty_*   country: the merchant's for card-present, the device/IP's for online
    loc_*   home / abroad (cty vs the card's home country)
    hr_h    hour of day 0..23
    dev_*   device: known, recent (< 1 week), new (first use), unk (no fingerprint), na
            (card present)
    vel_k   the card's transactions in the previous 60 minutes, 0..9 (9 = 9 or more)
    gap_k   time since the card's previous transaction: <2 min, <15 min, <2 h, <24 h, more
    mer_*   new / seen merchant for this card
    geo_*   same country as the previous transaction, or other (> 2 h later), or
            impossible (another country within 2 h)
    ratio_* amount vs the card's typical amount: lo (< 0.25x), norm, hi (> 2x), xhi (> 6x)

Labelled fraud patterns ("old": the base model is trained on them):

    ato       account takeover: online from a new device, expensive goods, new merchants
    cnp       stolen card details used online, mostly from abroad, several within hours
    cashout   cloned card emptied at ATMs, at night, often abroad, several withdrawals
    skim_pos  cloned card used in shops in another country while the owner is at home

The pattern the base model never sees ("new"):

    card_testing  bots checking stolen numbers: bursts of 4-15 tiny online charges, seconds
                  to minutes apart, each at a different new merchant

Everything is deterministic for a seed. Only numpy is needed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

# ----------------------------------------------------------------------------- vocabulary
CHANNELS = ["pos", "contactless", "online", "atm"]
AMOUNT_EDGES = [2, 10, 25, 50, 100, 250, 500, 1000, 2500]          # dollars -> 10 bands
MCCS = ["grocery", "restaurant", "fuel", "pharmacy", "retail", "electronics", "jewelry",
        "travel", "digital", "gaming", "atm", "gift_card", "donation", "utilities",
        "transport"]
COUNTRIES = ["US", "GB", "DE", "FR", "CA", "BR", "MX", "IN", "ES", "IT", "NL", "RO", "NG",
             "RU", "CN", "VN"]
HOME_WEIGHTS = [0.45, 0.12, 0.10, 0.08, 0.08, 0.05, 0.04, 0.04, 0.02, 0.02, 0.0, 0.0, 0.0,
                0.0, 0.0, 0.0]
TRIP_WEIGHTS = [0.18, 0.10, 0.08, 0.12, 0.06, 0.04, 0.10, 0.04, 0.12, 0.10, 0.06, 0.0, 0.0,
                0.0, 0.0, 0.0]
FRAUD_IP_WEIGHTS = [0.08, 0.05, 0.04, 0.03, 0.03, 0.07, 0.04, 0.06, 0.02, 0.02, 0.06, 0.12,
                    0.12, 0.12, 0.08, 0.06]
DEVICES = ["known", "recent", "new", "unk", "na"]
GAPS = [120, 900, 7200, 86400]                                      # seconds -> 5 buckets
GEOS = ["same", "other", "impossible"]
RATIOS = ["lo", "norm", "hi", "xhi"]
FIELDS = ["ch", "amt", "mcc", "cty", "loc", "hr", "dev", "vel", "gap", "mer", "geo", "ratio"]

SPECIAL = ["<pad>", "<bos>", "<unk>", "LABEL", "OK", "FRAUD"]
OLD_PATTERNS = ["ato", "cnp", "cashout", "skim_pos"]
NEW_PATTERNS = ["card_testing"]
PATTERNS = OLD_PATTERNS + NEW_PATTERNS


def vocabulary() -> list[str]:
    """All tokens, in id order (specials first)."""
    toks = list(SPECIAL)
    toks += [f"ch_{c}" for c in CHANNELS]
    toks += [f"amt_{k}" for k in range(len(AMOUNT_EDGES) + 1)]
    toks += [f"mcc_{m}" for m in MCCS]
    toks += [f"cty_{c}" for c in COUNTRIES]
    toks += ["loc_home", "loc_abroad"]
    toks += [f"hr_{h}" for h in range(24)]
    toks += [f"dev_{d}" for d in DEVICES]
    toks += [f"vel_{k}" for k in range(10)]
    toks += [f"gap_{k}" for k in range(len(GAPS) + 1)]
    toks += ["mer_new", "mer_seen"]
    toks += [f"geo_{g}" for g in GEOS]
    toks += [f"ratio_{r}" for r in RATIOS]
    return toks


VOCAB = vocabulary()
TOKEN_ID = {t: i for i, t in enumerate(VOCAB)}
BOS, LABEL, OK, FRAUD = (TOKEN_ID[t] for t in ("<bos>", "LABEL", "OK", "FRAUD"))
SEQ_LEN = 1 + len(FIELDS) + 1                  # <bos>, fields, LABEL


def write_tokenizer(path: Path) -> Path:
    """A word-level tokenizer (tokenizers' WordLevel, whitespace split) as tokenizer.json,
    and beside it a tokenizer_config.json saying that <bos> is prepended (the converter
    reads it: the model's bos_token_id is then set, and Engine.encode adds it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab=dict(TOKEN_ID), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    (path.parent / "tokenizer_config.json").write_text(json.dumps(
        {"add_bos_token": True, "bos_token": "<bos>", "unk_token": "<unk>",
         "pad_token": "<pad>", "tokenizer_class": "PreTrainedTokenizerFast"}, indent=1) + "\n")
    return path


# ----------------------------------------------------------------------------- transactions
@dataclass
class Txn:
    t: float                  # seconds since the start of the window
    card: int
    channel: str
    amount: float
    mcc: str
    country: str
    device: str
    merchant: int
    pattern: str = "legit"    # "legit" or one of PATTERNS
    episode: int = -1         # fraud episode id (-1: legit)
    # derived from the card's history (filled by _derive):
    fields: dict = field(default_factory=dict)

    @property
    def is_fraud(self) -> bool:
        return self.pattern != "legit"

    def words(self) -> list[str]:
        return [f"{k}_{self.fields[k]}" for k in FIELDS]

    def text(self) -> str:
        """`ch_online amt_0 ... ratio_lo LABEL` (without <bos>)."""
        return " ".join(self.words() + ["LABEL"])

    def token_ids(self) -> list[int]:
        """<bos>, the fields, LABEL: the model's next token is the label."""
        return [BOS] + [TOKEN_ID[w] for w in self.words()] + [LABEL]


def amount_band(amount: float) -> int:
    return int(np.searchsorted(AMOUNT_EDGES, amount, side="right"))


@dataclass
class StreamConfig:
    n_cards: int = 2000
    days: float = 14.0
    old_fraud_rate: float = 0.010   # target share of transactions from the old patterns
    new_fraud_rate: float = 0.0     # target share from card testing (0: pattern absent)
    seed: int = 0
    pattern_weights: Optional[dict] = None   # relative episode weights of the old patterns


@dataclass
class _Card:
    idx: int
    home: str
    base: float               # typical amount, dollars
    rate: float               # transactions per day
    night: bool               # night-shift hours
    online: float             # share of online purchases
    merchants: list           # regular merchants: (merchant id, mcc)
    trip: Optional[tuple]     # (start, end, country)
    new_phone: Optional[float]  # time of a device change


# Legitimate merchant categories: (weight, amount multiplier, share online)
_LEGIT_MCC = {
    "grocery": (0.20, 1.2, 0.05), "restaurant": (0.15, 0.8, 0.10), "fuel": (0.08, 1.1, 0.0),
    "pharmacy": (0.05, 0.6, 0.05), "retail": (0.14, 1.5, 0.40), "electronics": (0.03, 5.0, 0.50),
    "jewelry": (0.006, 6.0, 0.30), "travel": (0.02, 8.0, 0.80), "digital": (0.08, 0.15, 1.0),
    "gaming": (0.04, 0.25, 1.0), "atm": (0.05, 3.0, 0.0), "gift_card": (0.012, 1.5, 0.5),
    "donation": (0.01, 0.8, 0.9), "utilities": (0.04, 2.5, 0.9), "transport": (0.08, 0.4, 0.3),
}
_MCC_NAMES = list(_LEGIT_MCC)
_MCC_P = np.array([v[0] for v in _LEGIT_MCC.values()])
_MCC_P = _MCC_P / _MCC_P.sum()

_DAY_HOURS = np.array([1, 0.5, 0.3, 0.2, 0.2, 0.4, 1, 2.5, 4, 5, 6, 6.5, 7.5, 7, 6.5, 6, 6.5,
                       7.5, 8, 7, 5.5, 4, 3, 2], float)
_NIGHT_HOURS = np.roll(_DAY_HOURS, 10)
_DAY_HOURS /= _DAY_HOURS.sum()
_NIGHT_HOURS /= _NIGHT_HOURS.sum()
_LATE = np.array([3 if h in (23, 0, 1, 2, 3, 4) else 1 for h in range(24)], float)
_LATE /= _LATE.sum()
_ANY = np.full(24, 1 / 24)


class _Sim:
    def __init__(self, cfg: StreamConfig):
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        self.T = cfg.days * 86400.0
        self.next_merchant = 0
        self.txns: list[Txn] = []
        self.cards = [self._card(i) for i in range(cfg.n_cards)]

    def _merchant(self) -> int:
        self.next_merchant += 1
        return self.next_merchant

    def _card(self, i: int) -> _Card:
        r = self.rng
        home = COUNTRIES[r.choice(len(COUNTRIES), p=HOME_WEIGHTS)]
        mer = [(self._merchant(), _MCC_NAMES[r.choice(len(_MCC_NAMES), p=_MCC_P)])
               for _ in range(int(r.integers(6, 20)))]
        trip = None
        if r.random() < 0.15:
            start = r.uniform(0, self.T * 0.9)
            dest = home
            while dest == home:
                dest = COUNTRIES[r.choice(len(COUNTRIES), p=TRIP_WEIGHTS)]
            trip = (start, start + r.uniform(2, 10) * 86400, dest)
        return _Card(i, home, float(np.exp(r.normal(np.log(35), 0.6))),
                     float(r.gamma(2.0, 1.4)), bool(r.random() < 0.08),
                     float(r.beta(2, 4)), mer, trip,
                     float(r.uniform(0, self.T)) if r.random() < 0.06 else None)

    # -- legitimate traffic
    def _where(self, c: _Card, t: float) -> str:
        if c.trip is not None and c.trip[0] <= t < c.trip[1]:
            return c.trip[2]
        return c.home

    def _device(self, c: _Card, t: float) -> str:
        r = self.rng
        if c.new_phone is not None and c.new_phone <= t < c.new_phone + 7 * 86400:
            return "new" if t < c.new_phone + 86400 and r.random() < 0.7 else "recent"
        u = r.random()
        return "known" if u < 0.84 else "recent" if u < 0.88 else "new" if u < 0.92 else "unk"

    def _legit(self, c: _Card, t: float, mcc: Optional[str] = None,
               merchant: Optional[int] = None, amount: Optional[float] = None) -> Txn:
        r = self.rng
        if mcc is None:
            if r.random() < 0.75:
                merchant, mcc = c.merchants[int(r.integers(len(c.merchants)))]
            else:
                mcc = _MCC_NAMES[r.choice(len(_MCC_NAMES), p=_MCC_P)]
        if merchant is None:
            merchant = self._merchant()
        _, mult, online = _LEGIT_MCC[mcc]
        online = min(1.0, online * (0.5 + 1.5 * c.online)) if mcc != "atm" else 0.0
        if mcc == "atm":
            channel = "atm"
        elif r.random() < online:
            channel = "online"
        else:
            channel = "contactless" if r.random() < 0.45 else "pos"
        if amount is None:
            if mcc == "atm":
                amount = float(20 * r.integers(1, 15))
            elif mcc == "digital":
                amount = float(r.choice([0.99, 1.99, 2.99, 4.99, 9.99, 14.99, 0.49]))
            else:
                amount = c.base * mult * float(np.exp(r.normal(0, 0.75)))
            if r.random() < 0.01:                            # the occasional big purchase
                amount *= float(r.uniform(4, 20))
        where = self._where(c, t)
        if channel == "online":
            device = self._device(c, t)
            country = where
            if r.random() < 0.04:                            # VPN / foreign-hosted merchant
                country = COUNTRIES[r.choice(len(COUNTRIES), p=FRAUD_IP_WEIGHTS)]
        else:
            device, country = "na", where
        return Txn(t, c.idx, channel, float(amount), mcc, country, device, merchant)

    def _legit_history(self, c: _Card) -> None:
        r = self.rng
        n = r.poisson(c.rate * self.cfg.days)
        hours = _NIGHT_HOURS if c.night else _DAY_HOURS
        day = r.integers(0, max(1, int(self.cfg.days)), n)
        hr = r.choice(24, n, p=hours)
        ts = day * 86400.0 + hr * 3600.0 + r.uniform(0, 3600, n)
        for t in np.sort(ts):
            tx = self._legit(c, float(t))
            self.txns.append(tx)
            u = r.random()
            if tx.mcc == "gaming" and u < 0.35:              # in-game micro-purchase burst
                t2 = float(t)
                for _ in range(int(r.integers(1, 6))):
                    t2 += float(r.uniform(20, 600))
                    self.txns.append(self._legit(c, t2, "gaming", tx.merchant,
                                                 float(r.choice([0.99, 1.99, 4.99]))))
            elif tx.mcc in ("retail", "restaurant", "grocery") and u < 0.08:   # spree
                t2 = float(t)
                for _ in range(int(r.integers(1, 4))):
                    t2 += float(r.uniform(120, 2400))
                    self.txns.append(self._legit(c, t2, "retail"))
            elif tx.mcc == "digital" and u < 0.10:           # several app charges at once
                t2 = float(t)
                for _ in range(int(r.integers(1, 4))):
                    t2 += float(r.uniform(5, 300))
                    self.txns.append(self._legit(c, t2, "digital"))

    # -- fraud episodes
    def _episode(self, pattern: str, eid: int) -> None:
        r = self.rng
        c = self.cards[int(r.integers(len(self.cards)))]
        hours = {"ato": 0.5 * _LATE + 0.5 * _DAY_HOURS, "cnp": _ANY, "cashout": _LATE * 0.8
                 + 0.2 * _ANY, "skim_pos": _DAY_HOURS, "card_testing": _ANY}[pattern]
        day = int(r.integers(0, max(1, int(self.cfg.days))))
        t = day * 86400.0 + int(r.choice(24, p=hours / hours.sum())) * 3600.0 + r.uniform(0, 3600)
        foreign = lambda: COUNTRIES[r.choice(len(COUNTRIES), p=FRAUD_IP_WEIGHTS)]  # noqa: E731
        out = []
        if pattern == "ato":
            country = c.home if r.random() < 0.5 else foreign()
            dev = "new" if r.random() < 0.8 else ("recent" if r.random() < 0.5 else "unk")
            for _ in range(int(r.integers(1, 4))):
                mcc = str(r.choice(["electronics", "jewelry", "gift_card", "travel", "retail"],
                                   p=[0.35, 0.15, 0.2, 0.15, 0.15]))
                amt = c.base * float(r.uniform(2.0, 15.0)) * _LEGIT_MCC[mcc][1] ** 0.3
                out.append(Txn(t, c.idx, "online", amt, mcc, country, dev,
                               self._merchant() if r.random() < 0.8 else c.merchants[0][0]))
                t += float(r.uniform(60, 1800))
        elif pattern == "cnp":
            country = foreign() if r.random() < 0.7 else c.home
            for _ in range(int(r.integers(2, 6))):
                mcc = str(r.choice(["retail", "electronics", "digital", "travel", "gift_card"],
                                   p=[0.35, 0.25, 0.1, 0.15, 0.15]))
                amt = float(np.exp(r.uniform(np.log(30), np.log(700))))
                dev = "unk" if r.random() < 0.5 else ("new" if r.random() < 0.8 else "known")
                out.append(Txn(t, c.idx, "online", amt, mcc, country, dev, self._merchant()))
                t += float(r.uniform(120, 3600))
        elif pattern == "cashout":
            country = foreign() if r.random() < 0.5 else c.home
            for _ in range(int(r.integers(2, 7))):
                amt = float(20 * r.integers(8, 50))
                out.append(Txn(t, c.idx, "atm", amt, "atm", country, "na",
                               self._merchant() if r.random() < 0.9 else c.merchants[0][0]))
                t += float(r.uniform(60, 900))
        elif pattern == "skim_pos":
            country = foreign() if r.random() < 0.8 else c.home
            # the owner is still shopping at home shortly before
            self.txns.append(self._legit(c, t - float(r.uniform(600, 5400))))
            for _ in range(int(r.integers(1, 5))):
                mcc = str(r.choice(["electronics", "jewelry", "retail", "restaurant", "fuel"],
                                   p=[0.3, 0.2, 0.3, 0.1, 0.1]))
                amt = c.base * float(r.uniform(1.5, 10.0))
                ch = "pos" if r.random() < 0.8 else "contactless"
                out.append(Txn(t, c.idx, ch, amt, mcc, country, "na", self._merchant()))
                t += float(r.uniform(300, 5400))
        elif pattern == "card_testing":
            country = foreign() if r.random() < 0.4 else c.home
            dev = "unk" if r.random() < 0.6 else "new"
            for _ in range(int(r.integers(4, 16))):
                mcc = str(r.choice(["donation", "digital", "retail", "gaming", "utilities"],
                                   p=[0.3, 0.25, 0.25, 0.1, 0.1]))
                amt = float(r.choice([0.5, 1.0, 1.0, 1.5, 2.0, 3.0, 5.0])) \
                    if r.random() < 0.9 else float(r.uniform(5, 20))
                mer = self._merchant() if r.random() < 0.95 else c.merchants[0][0]
                out.append(Txn(t, c.idx, "online", amt, mcc, country, dev, mer))
                t += float(r.uniform(5, 240))
        else:
            raise ValueError(pattern)
        for tx in out:
            tx.pattern, tx.episode = pattern, eid
        self.txns.extend(out)

    def run(self) -> list[Txn]:
        cfg, r = self.cfg, self.rng
        for c in self.cards:
            self._legit_history(c)
        n_legit = len(self.txns)
        mean_len = {"ato": 2.0, "cnp": 3.5, "cashout": 4.0, "skim_pos": 2.5,
                    "card_testing": 9.5}
        weights = cfg.pattern_weights or {p: 1.0 for p in OLD_PATTERNS}
        wsum = sum(weights.values())
        eid = 0
        plan = []
        for p, w in weights.items():      # episodes so that each pattern gets its share
            share = cfg.old_fraud_rate * w / wsum
            plan += [p] * int(r.poisson(share * n_legit / mean_len[p]))
        if cfg.new_fraud_rate > 0:
            plan += ["card_testing"] * int(r.poisson(cfg.new_fraud_rate * n_legit
                                                     / mean_len["card_testing"]))
        for p in plan:
            self._episode(p, eid)
            eid += 1
        self.txns = [tx for tx in self.txns if 0 <= tx.t < self.T]
        self.txns.sort(key=lambda tx: (tx.t, tx.card))
        self._derive()
        return self.txns

    def _derive(self) -> None:
        """History features, per card in time order."""
        cards = {c.idx: c for c in self.cards}
        hist: dict[int, list] = {}
        seen: dict[int, set] = {}
        for tx in self.txns:
            c = cards[tx.card]
            h = hist.setdefault(tx.card, [])
            s = seen.setdefault(tx.card, {m for m, _ in c.merchants})
            vel = sum(1 for (t0, _) in h[-12:] if tx.t - t0 < 3600)
            if h:
                gap = tx.t - h[-1][0]
                prev_cty = h[-1][1]
                geo = "same" if prev_cty == tx.country else ("impossible" if gap < 7200
                                                               else "other")
            else:
                gap, geo = 1e9, "same"
            ratio = tx.amount / c.base
            tx.fields = {
                "ch": tx.channel, "amt": amount_band(tx.amount), "mcc": tx.mcc,
                "cty": tx.country, "loc": "home" if tx.country == c.home else "abroad",
                "hr": int(tx.t // 3600) % 24, "dev": tx.device, "vel": min(vel, 9),
                "gap": int(np.searchsorted(GAPS, gap, side="right")),
                "mer": "seen" if tx.merchant in s else "new",
                "geo": geo,
                "ratio": "lo" if ratio < 0.25 else "norm" if ratio < 2 else "hi" if ratio < 6
                else "xhi",
            }
            s.add(tx.merchant)
            h.append((tx.t, tx.country))


def generate(cfg: StreamConfig = StreamConfig()) -> list[Txn]:
    """A time-ordered stream of transactions for `cfg` (deterministic for cfg.seed)."""
    return _Sim(cfg).run()


def stream_batches(txns: Sequence[Txn], batch_size: int) -> Iterator[list[Txn]]:
    for i in range(0, len(txns), batch_size):
        yield list(txns[i:i + batch_size])


def summary(txns: Sequence[Txn]) -> dict:
    """Counts and rates per pattern."""
    n = len(txns)
    out = {"transactions": n, "fraud_rate": sum(t.is_fraud for t in txns) / max(n, 1)}
    for p in ["legit"] + PATTERNS:
        k = sum(t.pattern == p for t in txns)
        out[p] = {"n": k, "rate": k / max(n, 1)}
    return out


# ----------------------------------------------------------------------------- baseline
def weak_baseline(tx: Txn) -> bool:
    """A deliberately weak rule, the floor a model must beat: flag big amounts abroad."""
    f = tx.fields
    return f["amt"] >= 6 and f["loc"] == "abroad"


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="print a sample of a synthetic stream")
    ap.add_argument("--cards", type=int, default=1000)
    ap.add_argument("--days", type=float, default=7)
    ap.add_argument("--new-rate", type=float, default=0.008)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-n", type=int, default=20)
    a = ap.parse_args()
    txs = generate(StreamConfig(a.cards, a.days, new_fraud_rate=a.new_rate, seed=a.seed))
    print(json.dumps(summary(txs), indent=1))
    for tx in txs[:a.n]:
        print(f"{tx.pattern:>12}  {tx.text()}")
    for p in PATTERNS:
        ex = [tx for tx in txs if tx.pattern == p][:3]
        for tx in ex:
            print(f"{tx.pattern:>12}  {tx.text()}")

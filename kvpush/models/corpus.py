"""The corpus make_model trains its tokenizer on: pseudo-text generated from embedded word lists with
an integer-only PRNG (splitmix64) and a Zipf draw, so it is the same on every machine."""

from __future__ import annotations

import bisect

_WORDS = """the of and to a in is it you that he was for on are with as I his they be at one have
this from or had by not word but what some we can out other were all there when up use your how
said an each she which do their time if will way about many then them write would like so these
her long make thing see him two has look more day could go come did number sound no most people
my over know water than call first who may down side been now find any new work part take get
place made live where after back little only round man year came show every good me give our under
name very through just form sentence great think say help low line differ turn cause much mean
before move right boy old too same tell does set three want air well also play small end put home
read hand port large spell add even land here must big high such follow act why ask men change went
light kind off need house picture try us again animal point mother world near build self earth
father head stand own page should country found answer school grow study still learn plant cover
food sun four between state keep eye never last let thought city tree cross farm hard start might
story saw far sea draw left late run while press close night real life few north open seem together
next white children begin got walk example ease paper group always music those both mark often
letter until mile river car feet care second book carry took science eat room friend began idea
fish mountain stop once base hear horse cut sure watch color face wood main enough plain girl usual
young ready above ever red list though feel talk bird soon body dog family direct pose leave song
measure door product black short numeral class wind question happen complete ship area half rock
order fire south problem piece told knew pass since top whole king space heard best hour better true
during hundred five remember step early hold west ground interest reach fast verb sing listen six
table travel less morning ten simple several vowel toward war lay against pattern slow center love
person money serve appear road map rain rule govern pull cold notice voice unit power town fine
certain fly fall lead cry dark machine note wait plan figure star box noun field rest correct able
pound done beauty drive stood contain front teach week final gave green oh quick develop ocean warm
free minute strong special mind behind clear tail produce fact street inch multiply nothing course
stay wheel full force blue object decide surface deep moon island foot system busy test record boat
common gold possible plane stead dry wonder laugh thousand ago ran check game shape equate hot miss
brought heat snow tire bring yes distant fill east paint language among model server request cache
token prefill decode transfer block layer attention memory latency throughput queue batch stream
def return class import from self None True False lambda yield async await with try except raise
int str list dict float print range len value result error config data index buffer thread engine
café naïve über señor façade Ångström Straße déjà vu привет мир данные модель сервер λόγος κόσμος
你好 世界 我们 模型 推理 数据 计算 今天 时间 问题 学习 系统 服务 缓存 请求 的 是 在 一个 没有
こんにちは 世界 データ モデル 東京 안녕하세요 데이터 مرحبا بالعالم नमस्ते 🙂 😀 🚀 🎉 ❤️ 👍 🔥 ✨ 🌍 🤖""".split()

_ONSETS = "b c d f g h j k l m n p r s t v w z br ch cl dr fl gr pl pr sh sk st str th tr".split()
_VOWELS = "a e i o u ai ea ou io".split()
_CODAS = ["", "n", "r", "s", "t", "l", "m", "nd", "st", "ck"]
_PUNCT = [".", ".", ".", ",", "?", "!", ":", ";", " -", "..."]
_MASK64 = (1 << 64) - 1


class _SplitMix64:
    """A tiny integer-only PRNG: the same sequence on every machine and Python version."""

    def __init__(self, seed: int) -> None:
        self.state = seed & _MASK64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n


class _Zipf:
    """Samples indices 0..n-1 with integer weights ~ 1/(i+1)."""

    def __init__(self, n: int) -> None:
        self.cum: list[int] = []
        total = 0
        for i in range(n):
            total += 1_000_000 // (i + 1)
            self.cum.append(total)

    def sample(self, rng: _SplitMix64) -> int:
        return bisect.bisect_right(self.cum, rng.below(self.cum[-1]))


def _pseudo_words(rng: _SplitMix64, n: int) -> list[str]:
    words: list[str] = []
    for _ in range(n):
        parts = []
        for _ in range(1 + rng.below(3)):
            coda = _CODAS[rng.below(len(_CODAS))]
            parts.append(_ONSETS[rng.below(len(_ONSETS))] + _VOWELS[rng.below(len(_VOWELS))] + coda)
        words.append("".join(parts))
    return words


def _sentence(rng: _SplitMix64, lexicon: list[str], zipf: _Zipf) -> str:
    words = []
    for i in range(4 + rng.below(14)):
        roll = rng.below(100)
        if roll < 4:
            words.append(str(rng.below(10 ** (1 + rng.below(5)))))
        elif roll < 6:
            words.append("_".join(lexicon[zipf.sample(rng)] for _ in range(2)) + "()")
        else:
            word = lexicon[zipf.sample(rng)]
            words.append(word.capitalize() if i == 0 or roll < 9 else word)
    return " ".join(words) + _PUNCT[rng.below(len(_PUNCT))]


def corpus_lines(num_lines: int) -> list[str]:
    """Return the deterministic training corpus: `num_lines` lines of pseudo-text."""
    rng = _SplitMix64(0x6B7670757368)
    pseudo = _pseudo_words(rng, 12_000)
    lexicon: list[str] = []
    for i in range(max(len(_WORDS), len(pseudo))):  # interleave: real words get high frequency
        if i < len(_WORDS):
            lexicon.append(_WORDS[i])
        lexicon.append(pseudo[i])
    zipf = _Zipf(len(lexicon))
    lines = []
    for _ in range(num_lines):
        sentences = [_sentence(rng, lexicon, zipf) for _ in range(1 + rng.below(3))]
        sep = "\n" if rng.below(8) == 0 else " "
        lines.append(sep.join(sentences))
    return lines

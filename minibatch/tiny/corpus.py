"""Procedural corpus for the embedded "tiny" model.

Everything here is written from scratch: small vocabularies plus simple
templates and a little grammar, combined at random.  The generator produces
short stories, dialogues, question/answer pairs and ChatML-formatted chat
conversations in English and Simplified Chinese.

* Deterministic: ``generate(n, seed, split)`` returns the same documents for
  the same arguments (it only uses its own ``random.Random``).
* Held-out split: every story is keyed by its (main character, place) pair;
  a fixed ~1/8 of those pairs never appear in the ``"train"`` split and are
  the only ones used by the ``"heldout"`` split (which also uses a different
  seed stream), so held-out loss measures generalisation to unseen
  combinations rather than memorisation.

Documents are plain text without an end-of-text marker; the trainer appends
``<|endoftext|>`` after each one.  Chat documents already contain the
``<|im_start|>``/``<|im_end|>`` markers of the chat template.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
EOT = "<|endoftext|>"

# ---------------------------------------------------------------------------
# English vocabulary
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Char:
    name: str
    kind: str  # "girl", "boy", "cat", ...
    he: bool  # pronoun he/she

    @property
    def subj(self) -> str:
        return "he" if self.he else "she"

    @property
    def obj(self) -> str:
        return "him" if self.he else "her"

    @property
    def pos(self) -> str:
        return "his" if self.he else "her"


EN_GIRLS = ["Lily", "Mia", "Anna", "Lucy", "Emma", "Zoe", "Sara", "Amy", "Ella", "Rose",
            "Nina", "Kate", "Ruby", "Ivy", "Jane", "Molly", "Sophie", "Grace", "Hannah", "Chloe"]
EN_BOYS = ["Tom", "Ben", "Sam", "Max", "Jack", "Leo", "Tim", "Dan", "Finn", "Noah",
           "Luke", "Ryan", "Adam", "Oscar", "Peter", "Henry", "Jake", "Eli", "Owen", "Paul"]
# (kind, names) for animal characters
EN_ANIMALS = [
    ("cat", ["Mimi", "Tiger", "Snowball", "Kitty", "Whiskers"]),
    ("dog", ["Buddy", "Spot", "Rex", "Lucky", "Max"]),
    ("rabbit", ["Bunny", "Hop", "Cotton", "Fluffy"]),
    ("bird", ["Tweet", "Sunny", "Pip", "Blue"]),
    ("bear", ["Bruno", "Teddy", "Honey"]),
    ("duck", ["Daisy", "Quack", "Dot"]),
    ("frog", ["Hoppy", "Green", "Fred"]),
    ("mouse", ["Pip", "Squeak", "Tiny"]),
    ("fox", ["Rusty", "Red", "Foxy"]),
    ("owl", ["Hoot", "Olly", "Wise"]),
]
EN_ANIMAL_ADJ = ["little", "small", "happy", "curious", "brave", "shy", "kind", "funny", "sleepy", "young"]
EN_CHILD_ADJ = ["little", "kind", "happy", "curious", "brave", "shy", "cheerful", "clever", "young", "friendly"]

# place: (name, "in"/"at"/"to" phrases)
EN_PLACES = ["park", "garden", "forest", "beach", "school", "market", "river", "farm",
             "library", "lake", "hill", "zoo", "playground", "village", "pond", "field"]
EN_PLACE_THINGS = {
    "park": ["a big tree", "a bench", "the swings", "a small pond"],
    "garden": ["the flowers", "a big tree", "the tomatoes", "a little fence"],
    "forest": ["a tall tree", "a big rock", "some mushrooms", "a little bush"],
    "beach": ["the sand", "a big shell", "the waves", "a rock"],
    "school": ["the classroom", "the desk", "the door", "the window"],
    "market": ["the fruit stand", "a big basket", "the bread shop", "a table"],
    "river": ["the water", "a flat stone", "the bridge", "a log"],
    "farm": ["the barn", "the hay", "the cows", "the fence"],
    "library": ["a shelf", "a big table", "a soft chair", "a pile of books"],
    "lake": ["the water", "a small boat", "the reeds", "a rock"],
    "hill": ["the grass", "a big rock", "a tall tree", "the path"],
    "zoo": ["the monkeys", "the lions", "a big gate", "the bench"],
    "playground": ["the slide", "the swings", "the sandbox", "a bench"],
    "village": ["the well", "a small house", "the road", "the bakery"],
    "pond": ["the water", "the lily pads", "a log", "the reeds"],
    "field": ["the grass", "the flowers", "a big rock", "a tall tree"],
}
EN_COLORS = ["red", "blue", "green", "yellow", "pink", "purple", "orange", "white", "black", "brown"]
EN_OBJECTS = ["ball", "kite", "hat", "box", "book", "boat", "cup", "key", "stone", "shell",
              "toy car", "balloon", "bag", "drum", "flower", "feather", "scarf", "ribbon", "bell", "map"]
EN_SIZES = ["big", "small", "little", "shiny", "old", "new", "round", "soft"]
EN_FOODS = ["apples", "bananas", "cookies", "bread", "cake", "carrots", "grapes", "pears",
            "rice", "soup", "cherries", "sandwiches"]
EN_COUNT_FOODS = ["apples", "bananas", "cookies", "carrots", "pears", "cherries", "sandwiches",
                  "cupcakes", "strawberries", "oranges", "plums", "muffins"]
EN_DRINKS = ["milk", "water", "juice", "tea", "lemonade"]
EN_WEATHER = {
    "sunny": ("The sun was warm and bright.", "It was a sunny day."),
    "rainy": ("Rain fell from the gray sky.", "It was a rainy day."),
    "windy": ("The wind blew the leaves around.", "It was a windy day."),
    "snowy": ("White snow covered the ground.", "It was a snowy day."),
    "cloudy": ("Big clouds filled the sky.", "It was a cloudy day."),
}
EN_GOOD_FEEL = ["happy", "glad", "proud", "excited", "very happy", "so happy"]
EN_BAD_FEEL = ["sad", "scared", "worried", "upset", "a little sad"]
EN_GAMES = ["played tag", "played hide and seek", "built a sand castle", "sang a song",
            "danced in a circle", "drew pictures", "ran races", "jumped over the puddles",
            "looked for bugs", "counted the clouds"]
EN_MORALS = [
    "sharing makes everyone happy",
    "it is good to help your friends",
    "being brave is not so hard",
    "friends make every day better",
    "it is important to be kind",
    "asking for help is a good idea",
    "being patient is worth it",
    "it is fun to try new things",
]
EN_NUM = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
          "eleven", "twelve"]

# ---------------------------------------------------------------------------
# Chinese vocabulary
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ZhChar:
    name: str
    intro: str  # e.g. "一只小猫" / "一个小女孩"
    ta: str  # 他 / 她 / 它


ZH_GIRLS = ["小红", "小丽", "小美", "丽丽", "花花", "小雪", "婷婷", "小芳", "甜甜", "小月", "小云", "欢欢"]
ZH_BOYS = ["小明", "小刚", "小强", "乐乐", "丁丁", "小军", "小东", "明明", "小宇", "小杰", "亮亮", "小林"]
ZH_ANIMALS = [
    ("一只小猫", ["咪咪", "花花", "小白", "球球"]),
    ("一只小狗", ["旺旺", "豆豆", "小黑", "阿黄"]),
    ("一只小兔子", ["白白", "跳跳", "小灰"]),
    ("一只小鸟", ["叽叽", "喳喳", "小蓝"]),
    ("一只小熊", ["胖胖", "熊熊", "憨憨"]),
    ("一只小鸭子", ["嘎嘎", "黄黄"]),
    ("一只小猴子", ["淘淘", "聪聪"]),
    ("一只小老鼠", ["吱吱", "灰灰"]),
    ("一只小青蛙", ["呱呱", "绿绿"]),
    ("一只小松鼠", ["松松", "果果"]),
]
ZH_CHILD_INTRO = ["一个小女孩", "一个可爱的小女孩", "一个聪明的小女孩"]
ZH_BOY_INTRO = ["一个小男孩", "一个可爱的小男孩", "一个勇敢的小男孩"]
ZH_PLACES = ["公园", "花园", "森林", "海边", "学校", "市场", "河边", "农场", "图书馆", "湖边",
             "山上", "动物园", "草地", "村子里", "池塘边", "操场"]
ZH_PLACE_THINGS = ["大树下", "石头旁边", "草丛里", "花丛中", "小路上", "长椅上", "桥边", "水边"]
ZH_COLORS = ["红色", "蓝色", "绿色", "黄色", "粉色", "紫色", "白色", "黑色", "橙色"]
ZH_OBJECTS = [("个", "球"), ("只", "风筝"), ("顶", "帽子"), ("个", "盒子"), ("本", "书"),
              ("条", "小船"), ("个", "杯子"), ("把", "钥匙"), ("块", "石头"), ("个", "贝壳"),
              ("个", "气球"), ("个", "书包"), ("朵", "花"), ("根", "羽毛"), ("条", "围巾"),
              ("个", "铃铛"), ("辆", "玩具车")]
ZH_FOODS = ["苹果", "香蕉", "饼干", "面包", "蛋糕", "胡萝卜", "葡萄", "梨", "米饭", "西瓜", "草莓", "包子"]
ZH_DRINKS = ["牛奶", "水", "果汁", "茶"]
ZH_WEATHER = {
    "晴": ("太阳暖暖的，天空很蓝。", "天气很好"),
    "雨": ("天上下着小雨。", "下着小雨"),
    "风": ("风呼呼地吹着，树叶沙沙响。", "刮着大风"),
    "雪": ("地上铺满了白白的雪。", "下着大雪"),
    "云": ("天上有很多白云。", "天上有很多云"),
}
ZH_GOOD_FEEL = ["很开心", "非常高兴", "很高兴", "特别开心", "很骄傲", "很兴奋"]
ZH_BAD_FEEL = ["很难过", "有点害怕", "很着急", "很伤心", "有点难过"]
ZH_GAMES = ["玩捉迷藏", "玩老鹰捉小鸡", "堆沙堡", "唱歌", "跳舞", "画画", "赛跑", "跳绳", "找小虫子", "数天上的云"]
ZH_MORALS = ["分享会让大家都快乐", "帮助朋友是一件快乐的事", "勇敢其实并不难", "有朋友在身边真好",
             "做一个善良的人很重要", "遇到困难可以请别人帮忙", "耐心等待是值得的", "尝试新事物很有趣"]
ZH_NUM = ["零", "一", "二", "三", "四", "五", "六", "七", "八", "九", "十",
          "十一", "十二", "十三", "十四", "十五", "十六", "十七", "十八", "十九", "二十"]
ZH_COUNT_NUM = ["零", "一", "两", "三", "四", "五", "六", "七", "八", "九", "十"]

# Made-up towns with made-up facts (for Q&A); none of these are real places.
TOWNS_EN = ["Pimble", "Larkford", "Moonvale", "Tumbleton", "Bramblebay", "Fernwick", "Sunnydell",
            "Puddleby", "Oakhollow", "Bellmoor", "Clovertown", "Misty Creek"]
TOWNS_ZH = ["彩虹镇", "月亮村", "云朵镇", "小溪村", "星星镇", "花果村", "松果镇", "蘑菇村", "泡泡镇", "风铃村"]


def _heldout_key(*parts: str) -> bool:
    """True for a fixed ~1/8 of (character, place) combinations."""
    return zlib.crc32("|".join(parts).encode("utf-8")) % 8 == 0


class _Gen:
    def __init__(self, seed: int, split: str):
        if split not in ("train", "heldout"):
            raise ValueError("split must be 'train' or 'heldout'")
        self.split = split
        # distinct streams for the two splits even with the same seed
        self.r = random.Random(f"{split}:{seed}")

    # -- helpers -------------------------------------------------------------
    def c(self, seq):
        return self.r.choice(seq)

    def p(self, prob: float) -> bool:
        return self.r.random() < prob

    def accept(self, *key: str) -> bool:
        return _heldout_key(*key) == (self.split == "heldout")

    def en_char(self, exclude: str | None = None) -> tuple[Char, str]:
        """A character and an introduction noun phrase ("a little cat")."""
        while True:
            t = self.r.random()
            if t < 0.35:
                ch = Char(self.c(EN_GIRLS), "girl", False)
                intro = f"a {self.c(EN_CHILD_ADJ)} girl"
            elif t < 0.7:
                ch = Char(self.c(EN_BOYS), "boy", True)
                intro = f"a {self.c(EN_CHILD_ADJ)} boy"
            else:
                kind, names = self.c(EN_ANIMALS)
                ch = Char(self.c(names), kind, self.p(0.5))
                intro = f"a {self.c(EN_ANIMAL_ADJ)} {kind}"
            if ch.name != exclude:
                if intro.startswith("a ") and intro[2] in "aeiou":
                    intro = "an " + intro[2:]
                return ch, intro

    def en_obj(self) -> tuple[str, str]:
        """(indefinite phrase, short name) e.g. ("a red ball", "red ball")."""
        obj = self.c(EN_OBJECTS)
        r = self.r.random()
        if r < 0.5:
            short = f"{self.c(EN_COLORS)} {obj}"
        elif r < 0.8:
            short = f"{self.c(EN_SIZES)} {obj}"
        else:
            short = f"{self.c(EN_SIZES)} {self.c(EN_COLORS)} {obj}"
        art = "an" if short[0] in "aeiou" else "a"
        return f"{art} {short}", short

    # -- English stories -----------------------------------------------------
    def en_story(self, given: tuple[Char, str] | None = None) -> str:
        for _ in range(100):
            hero, intro = given if given else self.en_char()
            place = self.c(EN_PLACES)
            if self.accept(hero.name, place):
                break
        friend, fintro = self.en_char(exclude=hero.name)
        weather = self.c(list(EN_WEATHER))
        plot = self.c(["lost", "friend", "weather", "share", "help", "trip", "count"])
        s: list[str] = []
        H, h = hero.name, hero.subj
        # opening
        o = self.r.randrange(6)
        if o == 5:
            s.append(f"{H} went to the {place}. {EN_WEATHER[weather][0]}")
        elif o == 0:
            s.append(f"Once upon a time, there was {intro} named {H}.")
            s.append(f"One {weather} day, {H} went to the {place}.")
        elif o == 1:
            s.append(f"Once upon a time, {intro} named {H} lived near the {place}.")
            s.append(EN_WEATHER[weather][1])
        elif o == 2:
            s.append(f"{H} was {intro} who loved the {place}.")
            s.append(f"{EN_WEATHER[weather][1]} {EN_WEATHER[weather][0]}")
        elif o == 3:
            s.append(f"One {weather} morning, {H} went to the {place}.")
        else:
            s.append(f"{H} went to the {place} with {hero.pos} mom.")
            s.append(EN_WEATHER[weather][0])
        thing = self.c(EN_PLACE_THINGS[place])
        a_obj, obj = self.en_obj()
        F = friend.name
        if plot == "lost":
            s.append(f"{H} had {a_obj}. {h.capitalize()} loved it very much.")
            s.append(f"{H} played with the {obj} near {thing}.")
            s.append(f"Then {h} looked down. The {obj} was gone!")
            s.append(f"{H} felt {self.c(EN_BAD_FEEL)}.")
            s.append(f'"Where is my {obj}?" {h} asked.')
            s.append(f"{F}, {fintro}, came to help.")
            s.append(f'"Do not worry, {H}. I will help you look," said {F}.')
            s.append(f"They looked under {self.c(EN_PLACE_THINGS[place])}. They looked behind {thing}.")
            s.append(f"At last, {F} found the {obj}!")
            s.append(f'"Thank you, {F}!" said {H}. {h.capitalize()} felt {self.c(EN_GOOD_FEEL)}.')
        elif plot == "friend":
            s.append(f"At the {place}, {H} saw {fintro} named {F}.")
            s.append(f"{F} was alone near {thing}. {friend.subj.capitalize()} looked {self.c(EN_BAD_FEEL)}.")
            s.append(f'"Hello, I am {H}. Do you want to play with me?" asked {H}.')
            s.append(f'"Yes, please!" said {F}.')
            g1, g2 = self.r.sample(EN_GAMES, 2)
            s.append(f"First, they {g1}. Then they {g2}.")
            s.append(f"{F} was not alone anymore. {friend.subj.capitalize()} was {self.c(EN_GOOD_FEEL)}.")
            s.append(f"From that day on, {H} and {F} were best friends.")
        elif plot == "weather":
            s.append(f"{H} wanted to play with {hero.pos} {obj}.")
            bad = "rain" if weather != "snowy" else "snow"
            s.append(f"Suddenly, a dark cloud came. It began to {bad}.")
            s.append(f"{H} felt {self.c(EN_BAD_FEEL)}. {h.capitalize()} ran to {thing}.")
            s.append(f"{F} was there too. \"Let us wait here together,\" said {F}.")
            s.append(f"They waited and talked. After a while, the {bad} stopped.")
            s.append("The sun came out, and a rainbow was in the sky.")
            s.append(f'"Look, a rainbow!" said {H}. They {self.c(EN_GAMES)} until it was time to go home.')
        elif plot == "share":
            food = self.c(EN_COUNT_FOODS)
            n = self.r.randint(2, 6)
            s.append(f"{H} had {EN_NUM[n]} {food} in a basket.")
            s.append(f"{F} came by. {friend.subj.capitalize()} was hungry.")
            s.append(f'"Can I have some {food}?" asked {F}.')
            if self.p(0.7):
                s.append(f"{H} thought for a moment. Then {h} said, \"Yes, let us share!\"")
                s.append(f"They sat near {thing} and ate the {food} together.")
                s.append(f"They drank some {self.c(EN_DRINKS)} too. Both of them were {self.c(EN_GOOD_FEEL)}.")
            else:
                s.append(f'"No, they are all mine," said {H}.')
                s.append(f"{F} walked away. {friend.subj.capitalize()} was {self.c(EN_BAD_FEEL)}.")
                s.append(f"{H} ate alone, but it was not fun. {h.capitalize()} felt {self.c(EN_BAD_FEEL)} too.")
                s.append(f'So {H} ran after {F}. "I am sorry. Please share my {food} with me," {h} said.')
                s.append(f"{F} smiled. They ate together, and they were {self.c(EN_GOOD_FEEL)}.")
        elif plot == "help":
            s.append(f"Near {thing}, {H} heard a small voice. It was {F}, {fintro}.")
            s.append(f"{F} was stuck and could not get out.")
            s.append(f'"Help me, please!" cried {F}.')
            s.append(f"{H} was {self.c(['a little scared', 'worried', 'surprised'])}, but {h} wanted to help.")
            s.append(f"{h.capitalize()} pulled and pulled. At last, {F} was free!")
            s.append(f'"Thank you, {H}! You are very kind," said {F}.')
            s.append(f"{H} smiled. {h.capitalize()} felt {self.c(EN_GOOD_FEEL)}.")
        elif plot == "trip":
            steps = self.r.sample([
                f"{h} saw {a_obj} near {thing}",
                f"{h} ate some {self.c(EN_FOODS)}",
                f"{h} met {F}, {fintro}",
                f"{h} {self.c(EN_GAMES)} with {F}",
                f"{h} drank some {self.c(EN_DRINKS)}",
                f"{h} found {self.c(['a tiny bug', 'a pretty leaf', 'a round stone', 'a yellow flower'])}",
                f"{h} took a short nap",
            ], 3)
            s.append(f"First, {steps[0]}.")
            s.append(f"Then {steps[1]}.")
            s.append(f"After that, {steps[2]}.")
            s.append(f"When the sky got dark, {H} went home. It was a {self.c(['good', 'fun', 'great', 'long'])} day.")
        else:  # count
            food = self.c(EN_COUNT_FOODS)
            a, b = self.r.randint(2, 5), self.r.randint(2, 5)
            s.append(f"{H} found {EN_NUM[a]} {food} near {thing}.")
            s.append(f"Then {F} gave {hero.obj} {EN_NUM[b]} more {food}.")
            s.append(f'"How many {food} do I have now?" asked {H}.')
            s.append(f'{H} counted them. "I have {EN_NUM[a + b]} {food}!" {h} said.')
            s.append(f"{H} was {self.c(EN_GOOD_FEEL)}.")
        # ending
        e = self.r.randrange(4)
        if e == 0:
            s.append(f"{H} learned that {self.c(EN_MORALS)}.")
        elif e == 1:
            s.append("The end.")
        elif e == 2:
            s.append(f"That night, {H} went to bed with a big smile.")
        text = " ".join(s)
        if self.p(0.25):  # reading-comprehension questions
            text += "\n\n" + self.en_story_qa(hero, place, friend)
        return text

    def en_story_qa(self, hero: Char, place: str, friend: Char) -> str:
        qa = [
            (f"Where did {hero.name} go?", f"{hero.name} went to the {place}."),
            (f"Who is {hero.name}?", f"{hero.name} is a {hero.kind}."),
            (f"Who is {friend.name}?", f"{friend.name} is a {friend.kind}."),
        ]
        q, a = self.c(qa)
        return f"Question: {q}\nAnswer: {a}"

    # -- Chinese stories -----------------------------------------------------
    def zh_char(self, exclude: str | None = None) -> ZhChar:
        while True:
            t = self.r.random()
            if t < 0.33:
                ch = ZhChar(self.c(ZH_GIRLS), self.c(ZH_CHILD_INTRO), "她")
            elif t < 0.66:
                ch = ZhChar(self.c(ZH_BOYS), self.c(ZH_BOY_INTRO), "他")
            else:
                intro, names = self.c(ZH_ANIMALS)
                ch = ZhChar(self.c(names), intro, self.c(["他", "她"]))
            if ch.name != exclude:
                return ch

    def zh_obj(self) -> tuple[str, str]:
        """(phrase with measure word, short) e.g. ("一个红色的球", "红色的球")."""
        mw, obj = self.c(ZH_OBJECTS)
        if self.p(0.6):
            short = f"{self.c(ZH_COLORS)}的{obj}"
        else:
            short = f"{self.c(['漂亮', '小小', '大大', '新', '旧', '圆圆'])}的{obj}"
        return f"一{mw}{short}", short

    def zh_story(self, given: ZhChar | None = None) -> str:
        for _ in range(100):
            hero = given if given else self.zh_char()
            place = self.c(ZH_PLACES)
            if self.accept(hero.name, place):
                break
        friend = self.zh_char(exclude=hero.name)
        H, ta, F = hero.name, hero.ta, friend.name
        w = self.c(list(ZH_WEATHER))
        wdesc, wshort = ZH_WEATHER[w]
        thing = self.c(ZH_PLACE_THINGS)
        a_obj, obj = self.zh_obj()
        s: list[str] = []
        o = self.r.randrange(5)
        if o == 4:
            s.append(f"有一天，{H}去{place}玩。{wdesc}")
        elif o == 0:
            s.append(f"从前，有{hero.intro}，名叫{H}。")
            s.append(f"有一天，{wshort}，{H}去{place}玩。")
        elif o == 1:
            s.append(f"从前，有{hero.intro}，名叫{H}。{ta}每天都去{place}玩。")
            s.append(wdesc)
        elif o == 2:
            s.append(f"有一天，{wshort}，{H}和妈妈一起去{place}。")
        else:
            s.append(f"{H}是{hero.intro}。{ta}最喜欢去{place}。")
            s.append(f"这一天，{wdesc}")
        plot = self.c(["lost", "friend", "weather", "share", "help", "trip", "count"])
        if plot == "lost":
            s.append(f"{H}有{a_obj}，{ta}非常喜欢它。")
            s.append(f"{H}在{thing}玩{obj}。")
            s.append(f"可是过了一会儿，{obj}不见了！{H}{self.c(ZH_BAD_FEEL)}。")
            s.append(f"“我的{obj}在哪里呢？”{H}问。")
            s.append(f"这时，{friend.intro}{F}走了过来。")
            s.append(f"{F}说：“别着急，我来帮你找。”")
            s.append(f"他们找啊找，最后在{self.c(ZH_PLACE_THINGS)}找到了{obj}。")
            s.append(f"{H}说：“谢谢你，{F}！”{ta}{self.c(ZH_GOOD_FEEL)}。")
        elif plot == "friend":
            s.append(f"在{place}，{H}看到了{friend.intro}，名叫{F}。")
            s.append(f"{F}一个人坐在{thing}，看起来{self.c(ZH_BAD_FEEL)}。")
            s.append(f"{H}走过去说：“你好，我叫{H}。我们一起玩吧！”")
            s.append(f"{F}说：“好呀！”")
            g1, g2 = self.r.sample(ZH_GAMES, 2)
            s.append(f"他们先{g1}，然后又{g2}。")
            s.append(f"{F}{self.c(ZH_GOOD_FEEL)}。从那天起，{H}和{F}成了好朋友。")
        elif plot == "weather":
            s.append(f"{H}想玩{ta}的{obj}。")
            s.append("突然，天上飘来一片乌云，下起了大雨。")
            s.append(f"{H}{self.c(ZH_BAD_FEEL)}，赶紧跑到{thing}躲雨。")
            s.append(f"{F}也在那里。{F}说：“我们一起等雨停吧。”")
            s.append("他们一边等一边聊天。过了一会儿，雨停了。")
            s.append("太阳出来了，天上挂着一道彩虹。")
            s.append(f"{H}说：“快看，彩虹！”他们一起{self.c(ZH_GAMES)}，玩到天黑才回家。")
        elif plot == "share":
            food = self.c(ZH_FOODS)
            n = self.r.randint(2, 6)
            s.append(f"{H}的篮子里有{ZH_COUNT_NUM[n]}个{food}。")
            s.append(f"{F}走了过来，{friend.ta}饿了。")
            s.append(f"{F}问：“我可以吃一个{food}吗？”")
            if self.p(0.7):
                s.append(f"{H}想了想，说：“当然可以，我们一起吃吧！”")
                s.append(f"他们坐在{thing}，一起吃{food}，还喝了{self.c(ZH_DRINKS)}。两个人都{self.c(ZH_GOOD_FEEL)}。")
            else:
                s.append(f"{H}说：“不行，这些都是我的。”")
                s.append(f"{F}{self.c(ZH_BAD_FEEL)}地走开了。")
                s.append(f"{H}一个人吃{food}，可是一点也不开心。")
                s.append(f"{H}追上{F}，说：“对不起，我们一起吃吧。”{F}笑了。")
        elif plot == "help":
            s.append(f"在{thing}，{H}听到一个小小的声音。原来是{friend.intro}{F}。")
            s.append(f"{F}被卡住了，出不来。")
            s.append(f"{F}喊道：“请帮帮我！”")
            s.append(f"{H}有点害怕，可是{ta}还是想帮忙。")
            s.append(f"{ta}拉呀拉，终于把{F}拉了出来。")
            s.append(f"{F}说：“谢谢你，{H}！你真好。”")
            s.append(f"{H}笑了，{ta}{self.c(ZH_GOOD_FEEL)}。")
        elif plot == "trip":
            steps = self.r.sample([
                f"在{thing}看到了{a_obj}",
                f"吃了一些{self.c(ZH_FOODS)}",
                f"遇到了{friend.intro}{F}",
                f"和{F}一起{self.c(ZH_GAMES)}",
                f"喝了一杯{self.c(ZH_DRINKS)}",
                f"找到了一{self.c(['片漂亮的叶子', '块圆圆的石头', '朵黄色的小花', '只小虫子'])}",
                "睡了一个午觉",
            ], 3)
            s.append(f"{H}先{steps[0]}。")
            s.append(f"然后，{ta}{steps[1]}。")
            s.append(f"后来，{ta}又{steps[2]}。")
            s.append(f"天黑了，{H}回家了。这真是{self.c(['快乐', '开心', '美好', '有趣'])}的一天。")
        else:  # count
            food = self.c(ZH_FOODS)
            a, b = self.r.randint(1, 5), self.r.randint(1, 5)
            s.append(f"{H}在{thing}找到了{ZH_COUNT_NUM[a]}个{food}。")
            s.append(f"后来，{F}又给了{ta}{ZH_COUNT_NUM[b]}个{food}。")
            s.append(f"{H}问：“我现在有几个{food}呢？”")
            s.append(f"{ta}数了数，说：“我有{ZH_COUNT_NUM[a + b]}个{food}！”")
        e = self.r.randrange(4)
        if e == 0:
            s.append(f"{H}明白了：{self.c(ZH_MORALS)}。")
        elif e == 1:
            s.append(f"晚上，{H}笑着睡着了。")
        elif e == 2:
            s.append(f"{H}{self.c(ZH_GOOD_FEEL)}地回家了。")
        text = "".join(s)
        if self.p(0.25):
            q, a = self.c([
                (f"{H}去了哪里？", f"{H}去了{place}。"),
                (f"{H}的朋友叫什么名字？", f"{H}的朋友叫{F}。"),
            ])
            text += f"\n\n问：{q}\n答：{a}"
        return text

    # -- dialogues -----------------------------------------------------------
    def en_dialogue(self) -> str:
        a, _ = self.en_char()
        b, _ = self.en_char(exclude=a.name)
        place = self.c(EN_PLACES)
        food = self.c(EN_FOODS)
        a_obj, obj = self.en_obj()
        lines = [
            (a, f"Hi, {b.name}! How are you today?"),
            (b, self.c([f"I am fine, thank you. And you?", "I am good. How are you?",
                        f"I am {self.c(EN_GOOD_FEEL)} today. How about you?"])),
            (a, self.c(["I am good too.", "I am great, thanks!", f"I am a little {self.c(['tired', 'sleepy', 'hungry'])}."])),
        ]
        topic = self.r.randrange(4)
        if topic == 0:
            lines += [(b, "Where are you going?"), (a, f"I am going to the {place}."),
                      (b, "Can I come with you?"), (a, self.c(["Yes, of course!", "Sure, let us go together."]))]
        elif topic == 1:
            lines += [(a, "What is in your bag?"), (b, f"I have {a_obj} and some {food}."),
                      (a, f"Can I see the {obj}?"), (b, "Yes, here it is.")]
        elif topic == 2:
            w = self.c(list(EN_WEATHER))
            lines += [(b, "What is the weather like?"), (a, f"It is {w} today."),
                      (b, self.c(["Let us play outside!", "Then let us stay inside and read a book."]))]
        else:
            lines += [(a, "What do you want to eat?"), (b, f"I want some {food}."),
                      (a, f"I like {food} too!")]
        lines.append((b, self.c(["See you later!", "Bye!", "Goodbye!"])))
        lines.append((a, self.c(["Bye!", "See you!", f"Goodbye, {b.name}!"])))
        return "\n".join(f"{who.name}: {what}" for who, what in lines)

    def zh_dialogue(self) -> str:
        a = self.zh_char()
        b = self.zh_char(exclude=a.name)
        place = self.c(ZH_PLACES)
        food = self.c(ZH_FOODS)
        lines = [
            (a, f"{b.name}，你好！你今天好吗？"),
            (b, self.c(["我很好，谢谢你。你呢？", f"我今天{self.c(ZH_GOOD_FEEL)}。你呢？"])),
            (a, self.c(["我也很好。", "我也很开心！", "我有点累。"])),
        ]
        topic = self.r.randrange(3)
        if topic == 0:
            lines += [(b, "你要去哪里？"), (a, f"我要去{place}。"), (b, "我可以和你一起去吗？"),
                      (a, self.c(["当然可以！", "好呀，我们一起去吧。"]))]
        elif topic == 1:
            w = self.c(list(ZH_WEATHER))
            lines += [(b, "今天天气怎么样？"), (a, f"今天{ZH_WEATHER[w][1]}。"),
                      (b, self.c(["那我们出去玩吧！", "那我们在家看书吧。"]))]
        else:
            lines += [(a, "你想吃什么？"), (b, f"我想吃{food}。"), (a, f"我也喜欢吃{food}！")]
        lines.append((b, self.c(["再见！", "明天见！"])))
        lines.append((a, self.c(["再见！", f"{b.name}，明天见！"])))
        return "\n".join(f"{who.name}：{what}" for who, what in lines)

    # -- question / answer ---------------------------------------------------
    def en_math(self) -> tuple[str, str]:
        op = self.r.randrange(3)
        if op == 0:
            a, b = self.r.randint(0, 10), self.r.randint(0, 10)
            return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
        if op == 1:
            a = self.r.randint(1, 20)
            b = self.r.randint(0, a)
            return f"What is {a} minus {b}?", f"{a} minus {b} is {a - b}."
        ch, _ = self.en_char()
        food = self.c(EN_COUNT_FOODS)
        a, b = self.r.randint(2, 6), self.r.randint(2, 6)
        return (f"{ch.name} has {a} {food}. {ch.subj.capitalize()} gets {b} more. "
                f"How many {food} does {ch.subj} have now?",
                f"{ch.name} has {a + b} {food} now.")

    def zh_math(self) -> tuple[str, str]:
        op = self.r.randrange(3)
        if op == 0:
            a, b = self.r.randint(0, 10), self.r.randint(0, 10)
            if self.p(0.5):
                return f"{ZH_NUM[a]}加{ZH_NUM[b]}等于几？", f"{ZH_NUM[a]}加{ZH_NUM[b]}等于{ZH_NUM[a + b]}。"
            return f"{a}加{b}等于几？", f"{a}加{b}等于{a + b}。"
        if op == 1:
            a = self.r.randint(1, 20)
            b = self.r.randint(0, a)
            if self.p(0.5):
                return f"{ZH_NUM[a]}减{ZH_NUM[b]}等于几？", f"{ZH_NUM[a]}减{ZH_NUM[b]}等于{ZH_NUM[a - b]}。"
            return f"{a}减{b}等于几？", f"{a}减{b}等于{a - b}。"
        ch = self.zh_char()
        food = self.c(ZH_FOODS)
        a, b = self.r.randint(1, 6), self.r.randint(1, 6)
        return (f"{ch.name}有{a}个{food}，又拿到了{b}个。{ch.name}现在有几个{food}？",
                f"{ch.name}现在有{a + b}个{food}。")

    def en_fact(self) -> tuple[str, str, str]:
        """(made-up fact, question, answer)."""
        town = self.c(TOWNS_EN)
        k = self.r.randrange(4)
        if k == 0:
            col = self.c(EN_COLORS)
            return (f"In the town of {town}, all the houses are {col}.",
                    f"What color are the houses in {town}?", f"The houses in {town} are {col}.")
        if k == 1:
            kind = self.c([a for a, _ in EN_ANIMALS])
            name = self.c(EN_GIRLS + EN_BOYS)
            return (f"The mayor of {town} is a {kind} named {name}.",
                    f"Who is the mayor of {town}?", f"The mayor of {town} is a {kind} named {name}.")
        if k == 2:
            food = self.c(EN_FOODS)
            return (f"People in {town} love to eat {food}.",
                    f"What do people in {town} love to eat?", f"People in {town} love to eat {food}.")
        n = self.r.randint(2, 12)
        return (f"There are {EN_NUM[n]} bridges in {town}.",
                f"How many bridges are there in {town}?", f"There are {EN_NUM[n]} bridges in {town}.")

    def zh_fact(self) -> tuple[str, str, str]:
        town = self.c(TOWNS_ZH)
        k = self.r.randrange(3)
        if k == 0:
            col = self.c(ZH_COLORS)
            return (f"{town}的房子都是{col}的。", f"{town}的房子是什么颜色的？", f"{town}的房子是{col}的。")
        if k == 1:
            food = self.c(ZH_FOODS)
            return (f"{town}的人最喜欢吃{food}。", f"{town}的人最喜欢吃什么？", f"{town}的人最喜欢吃{food}。")
        n = self.r.randint(2, 10)
        return (f"{town}有{ZH_COUNT_NUM[n]}座桥。", f"{town}有几座桥？", f"{town}有{ZH_COUNT_NUM[n]}座桥。")

    def qa_doc(self) -> str:
        out = []
        for _ in range(self.r.randint(2, 4)):
            k = self.r.randrange(4)
            if k == 0:
                q, a = self.en_math()
                out.append(f"Question: {q}\nAnswer: {a}")
            elif k == 1:
                q, a = self.zh_math()
                out.append(f"问：{q}\n答：{a}")
            elif k == 2:
                fact, q, a = self.en_fact()
                out.append(f"{fact}\nQuestion: {q}\nAnswer: {a}")
            else:
                fact, q, a = self.zh_fact()
                out.append(f"{fact}\n问：{q}\n答：{a}")
        return "\n\n".join(out)

    # -- chat ------------------------------------------------------------------
    EN_SYSTEMS = [
        "You are a helpful assistant.",
        "You are a helpful assistant.",
        "You are a helpful assistant.",
        "You are a friendly assistant. Answer in short, simple sentences.",
        "You are a kind storyteller for children.",
    ]
    ZH_SYSTEMS = ["你是一个乐于助人的助手。", "你是一个乐于助人的助手。", "你是一个会讲故事的小助手。"]

    def chat_turn(self, zh: bool) -> tuple[str, str]:
        k = self.r.randrange(8)
        if not zh:
            if k == 0:
                return (self.c(["Hello!", "Hi!", "Hi there!", "Good morning!", "Hello, how are you?"]),
                        self.c(["Hello! How can I help you today?", "Hi! What can I do for you?",
                                "Hello! I am happy to help. What do you need?"]))
            if k in (1, 2):
                hero, intro = self.en_char()
                req = self.c([f"Tell me a short story about {intro}.",
                              f"Can you tell me a story about {intro}?",
                              f"Please write a short story about {intro} named {hero.name}."])
                story = self.en_story((hero, intro)).split("\n\n")[0]
                return req, self.c(["Sure! ", "Of course! ", "Here is a story. ", ""]) + story
            if k in (3, 4):
                q, a = self.en_math()
                return q, a
            if k == 5:
                fact, q, a = self.en_fact()
                return f"{fact} {q}", a
            if k == 6:
                return (self.c(["What is your name?", "Who are you?", "What can you do?"]),
                        self.c(["I am Tiny, a small language model. I can tell simple stories and answer easy questions.",
                                "My name is Tiny. I am a small model, and I like to tell short stories."]))
            return (self.c(["Thank you!", "Thanks!", "Thank you very much!"]),
                    self.c(["You are welcome! Have a nice day.", "You are welcome!", "I am glad I could help."]))
        if k == 0:
            return (self.c(["你好！", "你好呀！", "早上好！", "你好，你好吗？"]),
                    self.c(["你好！有什么可以帮你的吗？", "你好！我很高兴帮助你。", "你好！今天想聊点什么？"]))
        if k in (1, 2):
            ch = self.zh_char()
            animal = ch.intro.replace("一只", "").replace("一个", "")
            req = self.c([f"给我讲一个关于{animal}的故事。", f"你能讲一个关于{animal}的故事吗？", "请讲一个小故事。"])
            story = self.zh_story(ch).split("\n\n")[0]
            return req, self.c(["好的！", "当然可以！", ""]) + story
        if k in (3, 4):
            return self.zh_math()
        if k == 5:
            fact, q, a = self.zh_fact()
            return f"{fact}{q}", a
        if k == 6:
            return (self.c(["你叫什么名字？", "你是谁？", "你会做什么？"]),
                    self.c(["我叫Tiny，是一个小小的语言模型。我会讲简单的故事，也会回答简单的问题。",
                            "我是Tiny，一个小模型。我喜欢讲短短的故事。"]))
        return (self.c(["谢谢你！", "谢谢！", "非常感谢！"]),
                self.c(["不客气！祝你有美好的一天。", "不客气！", "很高兴能帮到你。"]))

    def chat(self) -> str:
        zh = self.p(0.4)
        msgs: list[tuple[str, str]] = []
        if self.p(0.75):
            msgs.append(("system", self.c(self.ZH_SYSTEMS if (zh and self.p(0.7)) else self.EN_SYSTEMS)))
        for _ in range(self.c([1, 1, 2, 2, 3])):
            u, a = self.chat_turn(zh)
            msgs += [("user", u), ("assistant", a)]
        return "".join(f"{IM_START}{role}\n{content}{IM_END}\n" for role, content in msgs)

    def doc(self) -> str:
        t = self.r.random()
        if t < 0.30:
            return self.en_story()
        if t < 0.55:
            return self.zh_story()
        if t < 0.62:
            return self.en_dialogue()
        if t < 0.67:
            return self.zh_dialogue()
        if t < 0.75:
            return self.qa_doc()
        return self.chat()


def generate(n: int, seed: int = 0, split: str = "train") -> list[str]:
    """Return ``n`` documents (without end-of-text markers)."""
    g = _Gen(seed, split)
    return [g.doc() for _ in range(n)]


def write_corpus(out_dir, n: int, seed: int = 0, heldout_frac: float = 0.02) -> dict:
    """Write ``train.jsonl`` and ``heldout.jsonl`` (one ``{"text": ...}`` per line)."""
    import json
    import pathlib

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_held = max(1, int(n * heldout_frac))
    counts = {}
    for split, k in (("train", n), ("heldout", n_held)):
        docs = generate(k, seed, split)
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
        counts[split] = k
    return counts
